"""``python run.py mode=serve ...``: build the engine from the composed config and serve it with uvicorn.

Shutdown (SIGINT/SIGTERM): uvicorn stops accepting connections; at the same moment every in-flight
request is aborted (its stream gets a final ``finish_reason="abort"`` chunk and ``[DONE]``), so
open connections finish and the process exits with status 0.

Engine death (a fault that leaves engine state unknown, e.g. the model forward raised): every in-flight
request gets a 503 (``EngineDeadError``), ``/health`` and new requests answer 503, uvicorn shuts down
(forced after :data:`DEAD_SHUTDOWN_S`) and :func:`serve` raises ``EngineDeadError``, so the process exits
non-zero for its supervisor to restart it, as ``vllm serve`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework import registry
from framework.config import EngineConfig
from framework.core.faults import EngineDeadError
from framework.distributed.parallel_state import replica_cpus
from framework.engine.async_llm import AsyncLLM
from framework.engine.core import engine_facts
from framework.entrypoints.config_errors import exit_on_config_error
from framework.entrypoints.engine import build_engine, served_config
from framework.metrics.collector import MetricsCollector
from framework.model_executor.model_loader import load_tokenizer

logger = logging.getLogger("servelab.server")

#: seconds a dead engine's server waits for open connections (they already got their 503) before exiting
DEAD_SHUTDOWN_S = 3.0


def load_chat_template(value: str | None) -> str | None:
    """``server.chat_template``: the contents of a file when ``value`` is an existing path, else
    ``value`` itself as a Jinja template; None stays None (use the tokenizer's)."""
    if not value:
        return None
    path = Path(value).expanduser()
    return path.read_text(encoding="utf-8") if path.is_file() else value


def resolve_api_key(configured: str | None) -> str | None:
    """The bearer token clients must send: ``server.api_key``, else ``$SERVELAB_API_KEY``, else None (no auth)."""
    return configured or os.environ.get("SERVELAB_API_KEY") or None


def _uvicorn_server(config: Any, on_exit: Any) -> Any:
    """A ``uvicorn.Server`` that calls ``on_exit()`` on SIGINT/SIGTERM and does not re-raise the signal
    after its graceful shutdown (uvicorn >= 0.29 does, which would end the process with the signal
    instead of status 0)."""
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    return _Server(config)


#: finished requests and steps a server's metrics keep for its percentiles and timeline (the latest ones);
#: unbounded, a per-step record (~1 KB) grew a busy server's memory by tens of MiB an hour
SERVER_METRICS_RECORDS = 100_000


def build_server_engine(cfg: DictConfig, engine_config: EngineConfig) -> Any:
    """The engine to serve, after checking that the ``serve`` extra is installed.

    Raises:
        ImportError: the ``serve`` extra is missing (names the pip command).
        ValueError, FileNotFoundError: from ``build_engine``, or an engine whose clock is not real time
            (``executor=sim`` with ``clock=virtual``).
    """
    _check_serve_extra()

    engine = build_engine(engine_config, metrics=MetricsCollector(slo_ttft_ms=cfg.slo.ttft_ms, slo_tpot_ms=cfg.slo.tpot_ms,
                                                                  max_records=SERVER_METRICS_RECORDS),
                          defer_compile=True)
    if not engine.clock.realtime:  # clients wait in wall time; a simulated clock that jumps cannot serve them
        engine.shutdown()
        raise ValueError(_virtual_clock(engine_config))
    return engine


def _virtual_clock(engine_config: EngineConfig) -> str:
    """The refusal of an engine whose clock does not follow wall time."""
    return (f"mode=serve needs an engine clock that follows wall time; executor={engine_config.executor} runs a "
            "virtual one: set executor.params.clock=realtime")


def check_wall_clock(engine_config: EngineConfig) -> None:
    """Refuse, before any engine process starts, an executor whose clock will not follow wall time
    (``Executor.wall_clock``: ``executor=sim`` with ``clock=virtual``); the built engine's clock is checked again.

    Raises:
        ValueError: naming ``executor.params.clock=realtime``.
    """
    wall_clock = getattr(registry.get_class("executor", engine_config.executor), "wall_clock", None)
    if wall_clock is not None and not wall_clock(engine_config):  # a class without it: its built clock decides
        raise ValueError(_virtual_clock(engine_config))


def server_state(cfg: DictConfig, facts: Any, tokenizer: Any, llm: AsyncLLM, name: str, metrics: Any,
                 api_key: str | None, engine_config: EngineConfig | None = None) -> Any:
    """The routes' shared ``ServerState`` for an engine's facts (``EngineFacts``) and its ``AsyncLLM``
    (``cfg.server.chat_template``); with ``engine_config``, the served names: the base model and its LoRA
    adapters (``ServedModels``: ``lora.modules``, ``lora.allow_runtime_updates``)."""
    from framework.entrypoints.server.served_models import ServedModels
    from framework.entrypoints.server.serving import ServerState

    models = (ServedModels.from_config(name, engine_config, facts.max_model_len)
              if engine_config is not None else None)
    return ServerState(llm=llm, model_name=name, max_model_len=facts.max_model_len, vocab_size=facts.vocab_size,
                       tokenizer=tokenizer, supports_structured_outputs=facts.supports_structured_outputs,
                       chat_template=load_chat_template(cfg.server.get("chat_template")), api_key=api_key,
                       metrics=metrics, models=models)


def core_config(cfg: DictConfig, engine_config: EngineConfig) -> EngineConfig:
    """The config a server builds in each engine-core process (:func:`framework.entrypoints.engine.served_config`
    with ``server.engine_process`` and the ``executor`` the user asked for)."""
    return served_config(engine_config, bool(cfg.server.get("engine_process", True)),
                         str((cfg.get("executor") or {}).get("name", "auto")))


def replica_roles(engine_config: EngineConfig) -> list[str]:
    """Each engine core's role, in replica order: ``disagg.prefill_replicas=P`` makes the first ``P`` ``prefill``
    and the rest ``decode`` (P/D disaggregation); else every one ``both``."""
    n, p = engine_config.data_parallel_size, engine_config.disagg_prefill_replicas
    return ["prefill"] * p + ["decode"] * (n - p) if p else ["both"] * n


def replica_config(one: EngineConfig, role: str) -> EngineConfig:
    """The config of one engine core of ``role``: a prefill replica stores its prompts' KV through the KV connector
    (``kv_transfer.role=kv_producer``), a decode replica loads it (``kv_consumer``); ``both`` keeps ``one``."""
    if role == "both":
        return one
    return dataclasses.replace(one, kv_role="kv_producer" if role == "prefill" else "kv_consumer")


def start_front(cfg: DictConfig, engine_config: EngineConfig, on_dead: Any, metrics: Any) -> tuple[AsyncLLM, Any, Any]:
    """The ``AsyncLLM`` front of a server, its engine facts and tokenizer.

    ``server.engine_process=true`` (default): ``parallel.data_parallel_size`` engine-core processes (each pinned to
    its share of the CPUs, ``parallel_state.replica_cpus``; each possibly tensor-parallel), a router when there are several, the tokenizer loaded
    here; with ``disagg.prefill_replicas=P`` the first ``P`` prefill and the rest decode (:func:`replica_roles`). ``false``: the engine (an in-process data-parallel front when ``data_parallel_size > 1``) on a thread of
    this process.

    Raises:
        ValueError, FileNotFoundError, ImportError: the config is refused (a core's build, or the clock check).
    """

    if not cfg.server.get("engine_process", True):
        engine = build_server_engine(cfg, engine_config)
        llm = AsyncLLM(engine, on_dead=on_dead, startup=lambda: engine.maybe_compile(None), metrics=metrics)
        return llm, engine_facts(engine), engine.tokenizer
    from framework.engine.core_client import MPCoreClient

    _check_serve_extra()
    tokenizer, _ = load_tokenizer(engine_config.model, engine_config.tokenizer)
    n = engine_config.data_parallel_size
    router = (registry.create("router", engine_config.router, seed=engine_config.seed,
                              **engine_config.plugin_params("router")) if n > 1 else None)
    one = core_config(cfg, engine_config)  # each core process is one replica
    roles = replica_roles(engine_config)
    metrics_kwargs = {"slo_ttft_ms": cfg.slo.ttft_ms, "slo_tpot_ms": cfg.slo.tpot_ms,
                      "max_records": SERVER_METRICS_RECORDS}
    clients = [MPCoreClient(replica_config(one, roles[i]), replica_id=i, data_parallel_size=n,
                            metrics_kwargs=metrics_kwargs) for i in range(n)]
    llm = AsyncLLM.from_clients(clients, router=router, metrics=metrics, tokenizer=tokenizer, on_dead=on_dead,
                                roles=roles)
    try:
        facts = [client.wait_for_hello() for client in clients][0]
        if not facts.realtime_clock:  # clients wait in wall time; a simulated clock that jumps cannot serve them
            raise ValueError(_virtual_clock(engine_config))
    except BaseException:
        llm.shutdown(timeout_s=10)
        raise
    if n > 1:

        logger.info("data parallel: %d engine-core processes (CPUs %s, roles %s), router=%s", n,
                    [list(replica_cpus(i, n)) for i in range(n)], roles, engine_config.router)
    return llm, facts, tokenizer


def _check_serve_extra() -> None:
    """Raises ImportError naming the pip command when the ``serve`` extra is missing."""
    try:
        import msgspec  # noqa: F401
        import uvicorn  # noqa: F401
        import zmq  # noqa: F401

        import framework.entrypoints.server.app  # noqa: F401
        import framework.entrypoints.server.metrics  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"mode=serve needs the serve extra ({exc}); install it with "
                          "pip install -e '.[serve]' 'torch==2.13.0'") from exc


def serve(cfg: DictConfig, engine_config: EngineConfig) -> dict[str, Any]:
    """Serve ``engine_config`` over HTTP until SIGINT/SIGTERM; returns the engine's metrics summary.

    Reads ``cfg.server`` (``host``, ``port``, ``api_key``, ``served_model_name``, ``chat_template``,
    ``log_level``, ``engine_process``) and ``cfg.slo`` (goodput SLOs of the summary).

    Raises:
        SystemExit: a configuration mistake, before the port is bound: the ``serve`` extra is not
            installed (the message names the pip command), or ``build_engine`` refuses the config
            (``framework/entrypoints/config_errors.py``).
        EngineDeadError: the engine died while serving (after the server shut down; exit non-zero).
    """
    import uvicorn

    from framework.entrypoints.server.app import build_app
    from framework.entrypoints.server.metrics import ServerMetrics
    server_cfg = cfg.server
    name = server_cfg.get("served_model_name") or engine_config.model
    server: Any = None

    def on_dead(exc: BaseException) -> None:  # a client thread: stop serving, force it if connections linger
        logger.error("the engine died (%s: %s); shutting the server down", type(exc).__name__, exc)
        if server is None:  # died before the server existed: serve() stops it before it runs
            return
        server.should_exit = True
        threading.Timer(DEAD_SHUTDOWN_S, lambda: setattr(server, "force_exit", True)).start()

    # engine.compile=auto|true: a server's work is open-ended, so each core compiles at start, while uvicorn
    # already answers /health with 503 "compiling" (requests sent meanwhile wait)
    metrics = ServerMetrics(name, engine_config.data_parallel_size,
                            max_loras=engine_config.max_loras if engine_config.enable_lora else None)
    with exit_on_config_error():
        check_wall_clock(engine_config)
        llm, facts, tokenizer = start_front(cfg, engine_config, on_dead, metrics)
    state = server_state(cfg, facts, tokenizer, llm, name, metrics, api_key=resolve_api_key(server_cfg.get("api_key")),
                         engine_config=engine_config)
    config = uvicorn.Config(build_app(state), host=server_cfg.host, port=int(server_cfg.port),
                            log_level=server_cfg.get("log_level", "info"), timeout_graceful_shutdown=30)
    server = _uvicorn_server(config, on_exit=lambda: llm.shutdown(timeout_s=0))
    if llm.errored is not None:  # died before the server existed
        server.should_exit = True
    logger.info("serving %s at http://%s:%s/v1 (auth %s, engine core %s)", name, server_cfg.host, server_cfg.port,
                "on" if state.api_key else "off",
                "in-process" if llm.engine is not None else f"in {len(llm.clients)} process(es)")
    try:
        server.run()
    finally:
        llm.shutdown()
    if llm.errored is not None:
        raise EngineDeadError(f"the engine died while serving ({type(llm.errored).__name__}: {llm.errored}); "
                              "exiting non-zero so that a supervisor restarts the server") from llm.errored
    if llm.engine is not None:
        return llm.engine.metrics.summary()
    summaries = [llm.summaries.get(i) or {} for i in range(len(llm.clients))]
    return summaries[0] if len(summaries) == 1 else {"data_parallel_size": len(summaries), "replicas": summaries}
