"""servelab entry point: ``python run.py [group=option ...] [key=value ...]`` (``-m`` for sweeps).

One offline run (``mode=offline``; ``mode=serve`` starts the OpenAI server instead; ``mode=eval`` runs
lm-evaluation-harness against the served config, ``framework/entrypoints/eval.py``): compose the Hydra config, build the tracker and the engine, run the workload,
and write ``outputs.jsonl``, ``metrics.json``, ``resolved_config.yaml`` and ``run_record.json`` into the Hydra run dir
(``outputs/<date>/<time>/``; Hydra adds ``.hydra/``). Also installed as the ``servelab`` command.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from rich.console import Console  # noqa: E402

from framework import registry  # noqa: E402
from framework.engine.builder import resolve_dtype, validate_plugins  # noqa: E402
from framework.entrypoints.config_errors import exit_on_config_error, run_app  # noqa: E402
from framework.entrypoints.engine import served_config  # noqa: E402
from framework.entrypoints.hydra_config import (  # noqa: E402
    CONF_DIR,
    engine_config_from_cfg,
    register_config_nodes,
    sampling_params_from_cfg,
)
from framework.entrypoints.run_record import write_run_record  # noqa: E402
from framework.workloads.synthetic import theoretical_hit_rate, validate_arrivals  # noqa: E402

register_config_nodes()  # every registered plugin name is a valid group option, file or not

logger = logging.getLogger("servelab")
MODES = ("offline", "serve", "eval")
UIS = ("progress", "dashboard", "none")


# absolute config path: also right when started as the ``servelab`` console script (module ``run``)
@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    """Run the composed config; returns the metrics summary (Hydra sweepers may read it).

    A configuration mistake found while setting up (an unknown key or mode, a plugin that cannot run
    here, a missing model or workload file...) prints its message alone and exits with status 2
    (``framework/entrypoints/config_errors.py``; ``HYDRA_FULL_ERROR=1`` shows the traceback).
    """
    os.environ["HF_HUB_OFFLINE"] = "1"
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with exit_on_config_error():
        engine_config, tracker = _set_up(cfg, run_dir)
    with contextlib.ExitStack() as stack:
        if tracker is not None:
            stack.callback(tracker.close)
            observer = tracker
            if cfg.mode in ("serve", "eval"):  # tracker logging (W&B) runs on a relay thread, never stalling the loop
                from framework.entrypoints.hook_relay import ThreadedHookRelay

                observer = ThreadedHookRelay(tracker)
                stack.callback(observer.close)  # drained before tracker.close
            stack.enter_context(registry.registered(observer, name=f"tracker-{cfg.tracker.name}"))
        if cfg.mode == "serve":
            return _serve(cfg, engine_config, run_dir)
        if cfg.mode == "eval":
            return _eval(cfg, engine_config, run_dir)
        return _run_offline(cfg, engine_config, sampling_params_from_cfg(cfg.sampling), run_dir)


def _set_up(cfg: DictConfig, run_dir: Path) -> tuple[Any, Any]:
    """Check the composed config before any weights load, write ``resolved_config.yaml`` and
    ``run_record.json``, start the tracker.

    Returns:
        ``(engine_config, tracker)``; the tracker is ``None`` for ``tracker=none``.

    Raises:
        ValueError, FileNotFoundError, ImportError: a configuration mistake (the message names the fix).
    """
    if cfg.mode not in MODES:
        raise ValueError(f"unknown mode {cfg.mode!r}; valid: {', '.join(MODES)}")
    if cfg.get("ui", "progress") not in UIS:
        raise ValueError(f"unknown ui {cfg.ui!r}; valid: {', '.join(UIS)}")
    (run_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    engine_config = engine_config_from_cfg(cfg)
    sampling_params_from_cfg(cfg.sampling)  # unknown keys / bad values fail here too
    # unknown names / capabilities fail before the tracker starts or weights load (a server: what each core builds)
    validate_plugins(_served_config(cfg, engine_config) if cfg.mode == "serve" else engine_config)
    # run_record.json gets the dtype this machine runs (model.dtype=auto resolved); the engine resolves it again and
    # says why (metrics.json's dtype_reason), so it gets the config as the user gave it
    resolved = resolve_dtype(engine_config)
    validate_arrivals(cfg.workload)  # bad rates / traces fail before weights load too
    if cfg.mode == "eval":  # lm-eval installed, tasks named: before weights load
        from framework.entrypoints.eval import check_eval_config

        check_eval_config(cfg)
    record = write_run_record(run_dir, cfg, resolved)  # run_record.json: versions, git sha, plugin packages
    params = cfg.tracker.get("params")
    tracker_params = {} if params is None else OmegaConf.to_container(params, resolve=True)
    if "group" in tracker_params and tracker_params["group"] is None:
        tracker_params["group"] = record["sweep_group"]  # every job of a multirun in one tracker group
    tracker = registry.create("tracker", cfg.tracker.name, run_dir=str(run_dir),
                              config={**_without_secrets(OmegaConf.to_container(cfg, resolve=True)),
                                      "servelab_run": {k: v for k, v in record.items() if k != "config"}},
                              **tracker_params)
    return engine_config, tracker


def _served_config(cfg: DictConfig, engine_config: Any) -> Any:
    """The config each of a server's engine cores builds (``framework.entrypoints.engine.served_config``)."""
    return served_config(engine_config, bool(cfg.server.get("engine_process", True)),
                         str((cfg.get("executor") or {}).get("name", "auto")))


def _without_secrets(config: dict[str, Any]) -> dict[str, Any]:
    """The config for trackers (which may upload it) with ``server.api_key`` masked."""
    server = config.get("server")
    if isinstance(server, dict) and server.get("api_key"):
        config["server"] = {**server, "api_key": "***"}
    return config


def _serve(cfg: DictConfig, engine_config: Any, run_dir: Path) -> dict[str, Any]:
    """Serve the engine over HTTP (``framework/entrypoints/server``) until SIGINT/SIGTERM; then write ``metrics.json``."""
    from framework.entrypoints.server.launch import serve

    summary = serve(cfg, engine_config)
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _eval(cfg: DictConfig, engine_config: Any, run_dir: Path) -> dict[str, Any]:
    """lm-evaluation-harness against this config served in-process (``framework/entrypoints/eval.py``); writes
    ``metrics.json`` (engine metrics + ``eval`` scores), ``eval_results.json`` and ``eval_samples.jsonl``."""
    from framework.entrypoints.eval import resolve_tasks, run_eval
    from framework.entrypoints.server.launch import build_server_engine

    with exit_on_config_error():  # unknown tasks; the model may still be missing or refused
        tasks, task_manager = resolve_tasks(cfg.eval)
        engine = build_server_engine(cfg, engine_config)
    return run_eval(cfg, engine, engine_config, tasks, task_manager, run_dir)


def _run_offline(cfg: DictConfig, engine_config: Any, default_sampling: Any, run_dir: Path) -> dict[str, Any]:
    """Build the engine, run the workload, write the run files, report the summary."""
    from framework import build_engine
    from framework.metrics.collector import MetricsCollector

    with exit_on_config_error():  # the model may still be missing or refused
        engine = build_engine(engine_config, metrics=MetricsCollector(slo_ttft_ms=cfg.slo.ttft_ms,
                                                                      slo_tpot_ms=cfg.slo.tpot_ms))
    try:
        return _run_engine(cfg, engine, default_sampling, run_dir)
    finally:
        engine.shutdown()  # worker processes of executor=mp/ray end with the job (a sweep runs many)


def _run_engine(cfg: DictConfig, engine: Any, default_sampling: Any, run_dir: Path) -> dict[str, Any]:
    """Run the workload on a built engine, write the run files, report the summary."""
    from framework.entrypoints.offline_runner import run_workload
    from framework.metrics.collector import render_summary_table
    from framework.workloads.workload import build_workload

    with exit_on_config_error():  # the workload file may still be missing or refused
        items = build_workload(cfg.workload, engine.tokenizer, vocab_size=getattr(engine, "vocab_size", None),
                               max_model_len=engine.max_model_len)
    logger.info("running %d requests; outputs in %s", len(items), run_dir)
    with contextlib.ExitStack() as stack:
        if cfg.get("ui", "progress") == "dashboard":  # live rich dashboard fed by the lifecycle hooks
            from framework.entrypoints.dashboard import Dashboard

            dashboard = stack.enter_context(Dashboard(total_requests=len(items)))
            stack.enter_context(registry.registered(dashboard, name="dashboard"))
        records, summary = run_workload(engine, items, default_sampling, progress=cfg.get("ui", "progress") == "progress")
    with open(run_dir / "outputs.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    if all(item.prompt_token_ids is not None for item in items):
        summary["theoretical_prefix_hit_rate"] = theoretical_hit_rate(items, engine.config.block_size)
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_timeline(run_dir / "steps.csv", engine.metrics.timeline)
    Console().print(render_summary_table(summary))
    registry.call_hook("on_run_end", summary=summary)
    return summary


def _write_timeline(path: Path, rows: list[dict[str, float]]) -> None:
    """Per-step KV usage, fragmentation and concurrency as CSV (one row per engine step)."""
    import csv

    if not rows:
        return
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    run_app(main)
