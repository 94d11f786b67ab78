"""``build_engine``: the engine a front drives, for any config: one
:class:`~framework.engine.llm_engine.LLMEngine`, or with ``data_parallel_size > 1`` a
:class:`~framework.engine.data_parallel.DataParallelEngine` of that many replicas behind the router ``config.router``
(the choice of front is made here, in the entry points, so the builder of one engine knows nothing of it).
``LLM``, ``run.py``, ``servelab serve`` with ``server.engine_process=false``, ``servelab eval`` and scripts call it
(``framework.build_engine``); a server's engine-core processes each build one replica
(``framework.engine.builder.build_llm_engine``).
"""

from __future__ import annotations

import dataclasses

from framework import registry
from framework.config import EngineConfig
from framework.engine.builder import build_llm_engine, resolve_and_log_dtype, validate_plugins
from framework.engine.data_parallel import build_data_parallel_engine
from framework.interfaces.engine import EngineClient
from framework.metrics.collector import MetricsCollector


def build_engine(config: EngineConfig, metrics: MetricsCollector | None = None,
                 defer_compile: bool = False) -> EngineClient:
    """Build the engine for ``config`` (see the module docstring).

    Args:
        config: the run's configuration; ``dtype="auto"`` is resolved once for every replica.
        metrics: the front's collector (e.g. with goodput SLOs); default a plain one.
        defer_compile: ``engine.compile=true`` compiles at the first ``maybe_compile`` (a server's start-up).

    Returns:
        The engine (``engine.config`` holds the resolved config).

    Raises:
        registry.UnknownPluginError, ValueError: an unknown plugin (the router's included) or a config a plugin
            refuses, before any weights load.
        FileNotFoundError, ModuleNotFoundError: the model cannot be found.
        WorkerError: a worker rank failed to start (its traceback in the message).
    """
    if config.data_parallel_size <= 1:
        return build_llm_engine(config, metrics, defer_compile)
    config, choice = resolve_and_log_dtype(config)
    validate_plugins(config)  # every name (the router's too) before the first replica loads
    if config.disagg_prefill_replicas:  # an executor that runs both P/D pools in this process builds the front
        build_front = getattr(registry.get_class("executor", config.executor), "build_disaggregated_front", None)
        if build_front is not None:  # executor=sim (plugins/executors/_sim_disagg.py)
            return build_front(config, metrics)
    engine = build_data_parallel_engine(config, metrics, defer_compile)
    engine.metrics.front.model_info = {"dtype": choice.dtype, "dtype_reason": choice.reason}
    return engine


def served_config(config: EngineConfig, engine_process: bool = True, requested_executor: str = "auto") -> EngineConfig:
    """The config a server builds in each engine-core process: with ``engine_process`` (``server.engine_process``,
    the default) one replica (``data_parallel_size=1``) whose executor resolves again for one replica when the user
    asked for ``auto`` (``requested_executor``: ``uniproc`` for one rank); else ``config`` itself (the in-process
    front builds it whole). ``run.py`` validates this config, so what one replica supports (multi-LoRA,
    ``framework/engine/lora_support.py``) serves behind a data-parallel front of engine-core processes. A replica
    knows nothing of P/D disaggregation (``disagg_prefill_replicas=0``): the front gives each its role
    (``framework/entrypoints/server/launch.py``)."""
    if not engine_process:
        return config
    return dataclasses.replace(config, data_parallel_size=1, disagg_prefill_replicas=0,
                               executor="auto" if requested_executor == "auto" else config.executor)
