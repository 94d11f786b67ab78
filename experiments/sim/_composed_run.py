"""One offline run from Hydra overrides, for experiments that sweep configurations in one process
(``sim_scale.py``, ``sim_routers.py``): compose the config as ``run.py`` would, build the engine, run the
configured workload, shut down."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class ComposedRun:
    """What one run left: ``metrics.summary()``, the engine's metrics timeline, requests and wall seconds."""

    summary: dict[str, Any]
    timeline: list[Any]
    num_requests: int
    wall_s: float


def run_composed(overrides: list[str]) -> ComposedRun:
    """Compose ``overrides`` (``conf/config.yaml`` plus ``key=value``), build the engine, run its workload
    (``framework.entrypoints.offline_runner.run_workload``, no progress bar) and shut the engine down.

    Raises:
        ValueError: a bad configuration (from composing, validation or the workload).
    """
    from framework import build_engine
    from framework.entrypoints.hydra_config import engine_config_from_cfg, sampling_params_from_cfg
    from framework.entrypoints.offline_runner import run_workload
    from framework.entrypoints.profile import compose_config
    from framework.workloads.workload import build_workload

    cfg = compose_config(overrides)
    start = time.perf_counter()
    engine = build_engine(engine_config_from_cfg(cfg))
    try:
        items = build_workload(cfg.workload, engine.tokenizer, vocab_size=engine.vocab_size,
                               max_model_len=engine.max_model_len)
        _, summary = run_workload(engine, items, sampling_params_from_cfg(cfg.sampling), progress=False)
        timeline = list(engine.metrics.timeline)
    finally:
        engine.shutdown()
    return ComposedRun(summary, timeline, len(items), time.perf_counter() - start)
