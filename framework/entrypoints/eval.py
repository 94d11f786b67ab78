"""``servelab eval`` (== ``python run.py mode=eval``): accuracy beside throughput for one config.

It serves the composed config exactly as ``servelab serve`` would (same ``build_engine``, same OpenAI app),
on a free loopback port inside this process, runs EleutherAI's lm-evaluation-harness against it with the
field's usual route (``--model local-completions``: ``generate_until`` tasks send ordinary completions,
loglikelihood tasks send ``echo: true, logprobs: 1, max_tokens: 1`` and read the prompt tokens'
``token_logprobs``; the model's own tokenizer folder is handed to lm-eval, which sends token-id prompts), then
writes into the run dir:

- ``metrics.json``: the engine's summary of the evaluation traffic (throughput, latencies, prefix-cache hit
  rate...) plus ``eval`` = ``{task: {metric: value}}`` (lm-eval's ``acc,none`` -> ``acc``) and ``eval_s``, so
  ``servelab results`` tables and plots accuracy next to throughput over a sweep (``-m quant=none,int8_wo``);
  trackers get the same summary in ``on_run_end`` (W&B run summary);
- ``eval_results.json`` (lm-eval's ``results``, ``versions``, ``n-shot``, task configs) and ``eval_samples.jsonl``
  (one line per document: its ``resps``, the per-request loglikelihoods or generated strings).

lm-eval is an optional dependency (``pip install -e '.[eval]' 'torch==2.13.0'``). Tasks are lm-eval task
names: its own (servelab runs with ``HF_HUB_OFFLINE=1``, so only those whose datasets are in the local Hugging
Face datasets cache; where the hub is reachable run ``lm_eval --model local-completions`` against
``servelab serve`` instead, README) or YAML tasks
from ``eval.include_path``; the repository ships small local ones in ``data/eval_tasks`` (``servelab_mc``,
``servelab_ppl``, ``servelab_gen``), whose relative ``data_files`` are resolved against the repository root
here, so they run from any directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from framework import registry
from framework.config import EngineConfig
from framework.interfaces.engine import EngineClient

logger = logging.getLogger("servelab.eval")

#: the repository's local lm-eval tasks (YAML + JSONL)
TASKS_DIR = Path(__file__).resolve().parents[2] / "data" / "eval_tasks"
REPO_ROOT = TASKS_DIR.parents[1]
INSTALL_HINT = "pip install -e '.[eval]' 'torch==2.13.0'"
#: seconds to wait for the in-process server to accept connections
SERVER_START_S = 60.0


def check_eval_config(cfg: DictConfig) -> None:
    """Refuse a ``mode=eval`` config before any weights load.

    Raises:
        ImportError: lm-eval (or the ``serve`` extra) is not installed; the message names the pip command.
        ValueError: no ``eval.tasks``, or ``eval.include_path`` is not a folder.
    """
    for module, extra in (("lm_eval", "eval"), ("uvicorn", "serve")):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"mode=eval needs the {extra} extra ({module} is not installed): "
                              f"pip install -e '.[{extra}]' 'torch==2.13.0'")
    tasks = list(cfg.eval.get("tasks") or [])
    if not tasks:
        raise ValueError("eval.tasks is empty; name lm-eval tasks, e.g. eval.tasks=[servelab_mc,servelab_ppl] "
                         f"(local ones in {TASKS_DIR})")
    include = cfg.eval.get("include_path")
    if include and not Path(include).expanduser().is_dir():
        raise ValueError(f"eval.include_path={include!r} is not a folder of lm-eval task YAMLs")


def local_task_configs(folders: list[Path]) -> dict[str, dict[str, Any]]:
    """Task configs of the plain YAML files in ``folders`` (by ``task`` name), with relative ``data_files``
    made absolute: against the repository root when the file is there, else against the YAML's folder.
    YAMLs that ``yaml.safe_load`` cannot read (``!function`` tags) are left to lm-eval's own loader."""
    import yaml

    configs: dict[str, dict[str, Any]] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.yaml")):
            try:
                config = yaml.safe_load(path.read_text(encoding="utf-8"))
            except yaml.YAMLError:
                continue
            if not isinstance(config, dict) or not isinstance(config.get("task"), str):
                continue
            files = (config.get("dataset_kwargs") or {}).get("data_files")
            if isinstance(files, dict):
                config["dataset_kwargs"]["data_files"] = {split: _resolve(f, path.parent) for split, f in files.items()}
            elif isinstance(files, str):
                config["dataset_kwargs"]["data_files"] = _resolve(files, path.parent)
            configs[config["task"]] = config
    return configs


def _resolve(data_file: str, yaml_dir: Path) -> str:
    path = Path(data_file).expanduser()
    if path.is_absolute():
        return str(path)
    return str(REPO_ROOT / path if (REPO_ROOT / path).exists() else yaml_dir / path)


def flat_scores(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """lm-eval's ``results`` as ``{task: {metric: value}}``: ``"acc,none"`` -> ``acc``, another filter ``f`` ->
    ``metric/f``; non-numeric entries (``alias``) and ``"N/A"`` stderrs dropped."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results.items():
        row = {}
        for key, value in metrics.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            row[metric if filt == "none" else f"{metric}/{filt}"] = float(value)
        out[task] = row
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_tasks(ev: DictConfig) -> tuple[list[str | dict[str, Any]], Any]:
    """``eval.tasks`` for ``lm_eval.simple_evaluate``: the config (with absolute data paths) of a local YAML task
    (``data/eval_tasks``, ``eval.include_path``), else the name, and lm-eval's ``TaskManager``. lm-eval's own
    tasks are indexed only when a task is not local (its ~14,000 YAMLs take ~13 s to index on 2 cores).

    Raises:
        ValueError: a task name neither local nor known to lm-eval (the message lists the local ones).
    """
    from lm_eval.tasks import TaskManager

    include = Path(ev.include_path).expanduser().resolve() if ev.get("include_path") else None
    local = local_task_configs([TASKS_DIR] + ([include] if include else []))
    task_manager = TaskManager(include_path=str(include) if include else None,
                               include_defaults=not all(name in local for name in ev.tasks))
    unknown = [name for name in ev.tasks if name not in local and name not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; local tasks: {sorted(local)} (add YAMLs with "
                         "eval.include_path=DIR), or any of `lm_eval ls tasks`")
    return [local.get(name, name) for name in ev.tasks], task_manager


@contextlib.contextmanager
def serving_in_thread(cfg: DictConfig, engine: EngineClient, name: str) -> Iterator[tuple[str, Any]]:
    """Serve a built engine with the OpenAI app of ``servelab serve``, on a free 127.0.0.1 port, uvicorn on a
    thread (``name``: the served model name).

    Yields:
        ``(base_url, state)``; on exit the server stops and the engine loop and workers shut down.

    Raises:
        RuntimeError: the server did not accept connections within :data:`SERVER_START_S`.
    """
    import uvicorn

    from framework.engine.async_llm import AsyncLLM
    from framework.engine.core import engine_facts
    from framework.entrypoints.server.app import build_app
    from framework.entrypoints.server.launch import server_state
    from framework.entrypoints.server.metrics import ServerMetrics

    engine.maybe_compile(None)  # as a server: open-ended work (engine.compile=auto compiles now)
    metrics = ServerMetrics(name, engine.config.data_parallel_size)
    llm = AsyncLLM(engine, metrics=metrics)
    state = server_state(cfg, engine_facts(engine), engine.tokenizer, llm, name, metrics, api_key=None)  # no key
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="servelab-eval-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the evaluation server did not start on 127.0.0.1:{port}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(30)
        llm.shutdown()
        engine.shutdown()


def run_eval(cfg: DictConfig, engine: EngineClient, engine_config: EngineConfig, tasks: list[str | dict[str, Any]],
             task_manager: Any, run_dir: Path) -> dict[str, Any]:
    """Serve ``engine``, run lm-eval's ``local-completions`` on ``tasks`` (:func:`resolve_tasks`) against it,
    write the run files (module docstring) and call ``on_run_end``; returns the summary (engine metrics +
    ``eval``). Reads ``eval.limit``, ``num_fewshot``, ``batch_size`` (prompts per request), ``num_concurrent``
    (requests in flight), ``seed``, ``add_bos_token`` (:func:`add_bos_token`); the served name is ``server.served_model_name`` or ``model.path``."""
    import lm_eval

    ev = cfg.eval
    name = cfg.server.get("served_model_name") or engine_config.model
    with serving_in_thread(cfg, engine, name) as (base, state):
        tokenizer = engine_config.tokenizer or _model_folder(engine_config.model)
        model_args = {"model": name, "base_url": f"{base}/v1/completions", "tokenizer": tokenizer,
                      "tokenizer_backend": "huggingface", "tokenized_requests": True,
                      "max_length": state.max_model_len, "num_concurrent": int(ev.num_concurrent),
                      "max_retries": 1, "timeout": 3600, "seed": int(ev.seed),
                      "add_bos_token": add_bos_token(ev.get("add_bos_token", "auto"), engine.tokenizer)}
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks,
                                      task_manager=task_manager, limit=ev.get("limit"),
                                      num_fewshot=ev.get("num_fewshot"), batch_size=int(ev.batch_size),
                                      log_samples=True, random_seed=int(ev.seed), numpy_random_seed=int(ev.seed),
                                      torch_random_seed=int(ev.seed), fewshot_random_seed=int(ev.seed))
        eval_s = time.perf_counter() - t0
        summary = engine.metrics.summary()
    summary["eval"] = flat_scores(out["results"])
    summary["eval_s"] = eval_s
    _write_eval_files(run_dir, out)
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info("eval: %s in %.1f s", json.dumps(summary["eval"]), eval_s)
    registry.call_hook("on_run_end", summary=summary)
    return summary


def add_bos_token(setting: Any, tokenizer: Any) -> bool:
    """``eval.add_bos_token``: ``auto`` is what the tokenizer does by default (lm-eval's ``hf`` backend leaves
    special tokens to the tokenizer, its API backends add none unless told: ``auto`` makes them agree), else the
    boolean given."""
    if str(setting) != "auto":
        return bool(setting)
    return len(tokenizer("a").input_ids) > len(tokenizer("a", add_special_tokens=False).input_ids)


def _model_folder(model: str) -> str:
    from framework.model_executor.model_loader import resolve_model_path

    return resolve_model_path(model)


def _write_eval_files(run_dir: Path, out: dict[str, Any]) -> None:
    """``eval_results.json`` (everything but the samples) and ``eval_samples.jsonl`` (task, doc id, resps)."""
    keep = {k: out.get(k) for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples", "configs")}
    (run_dir / "eval_results.json").write_text(json.dumps(keep, indent=2, default=str) + "\n")
    with open(run_dir / "eval_samples.jsonl", "w", encoding="utf-8") as f:
        for task, samples in (out.get("samples") or {}).items():
            for sample in samples:
                f.write(json.dumps({"task": task, "doc_id": sample.get("doc_id"), "resps": sample.get("resps"),
                                    "target": sample.get("target")}, default=str) + "\n")
