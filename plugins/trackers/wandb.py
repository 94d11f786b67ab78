"""Weights & Biases tracker: logs the resolved config (flattened: ``scheduler.name``), per-step
``SchedulerStats`` as history, the run summary, and KV-usage / running-waiting line charts.

All jobs of a Hydra multirun share one W&B group named after the sweep (``run.py`` fills
``group`` from the sweep dir), so the W&B UI groups and pivots a sweep as one experiment.

Offline by default: the run is written under ``<run_dir>/wandb/offline-run-*`` and can be
uploaded later with ``wandb sync``; no network is needed. ``wandb`` itself is imported only when
the tracker is built (``tracker=wandb``), never when the plugin module is loaded.
"""

from __future__ import annotations

import math
import os
from typing import Any

from framework import hookimpl
from framework.core.outputs import SchedulerStats
from framework.hookspecs import Register
from framework.interfaces import Tracker
from framework.metrics.results import flatten

MODES = ("offline", "online", "disabled")
# W&B line charts logged at the end of a run: chart name -> SchedulerStats fields over steps
CHARTS = {"kv_cache_usage": ("kv_cache_usage",), "running_waiting": ("num_running_reqs", "num_waiting_reqs")}
CHART_SERIES = tuple(dict.fromkeys(k for keys in CHARTS.values() for k in keys))


class WandbTracker(Tracker):
    """One W&B run per engine run.

    Args:
        run_dir: the Hydra run dir; W&B writes ``<run_dir>/wandb/`` (nothing in ``disabled`` mode).
        config: the resolved run config (plain dict), stored flattened as the W&B run config
            (``{"scheduler": {"name": "fcfs"}}`` -> ``scheduler.name``, so the UI can pivot on it).
        mode: ``offline`` (default, no network) | ``online`` | ``disabled`` (no files, no-op).
        project, entity, run_name, tags: the W&B run's project, team, display name and tags
            (``run_name``, not ``name``: ``name`` is the registry key in ``registry.create``).
        group, job_type: the W&B group (one per sweep) and job type; ``None`` = none.

    Raises:
        ValueError: an unknown ``mode``.
    """

    name = "wandb"

    def __init__(self, run_dir: str = ".", config: dict[str, Any] | None = None, mode: str = "offline",
                 project: str = "servelab", entity: str | None = None, run_name: str | None = None,
                 tags: list[str] | None = None, group: str | None = None, job_type: str | None = None,
                 **params: Any) -> None:
        super().__init__(run_dir=run_dir, **params)
        if mode not in MODES:
            raise ValueError(f"wandb tracker: mode must be one of {', '.join(MODES)}, got {mode!r} "
                             "(set tracker.params.mode=offline)")
        if params:
            raise TypeError(f"wandb tracker: unknown params {sorted(params)}; "
                            "valid: mode, project, entity, run_name, tags, group, job_type")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        if mode != "disabled":
            os.makedirs(run_dir, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, quiet=True, x_disable_stats=True,
                                  disable_git=True, disable_code=True, disable_job_creation=True)
        # create_new: a sweep in one process (Hydra's basic launcher) gets one run per job
        self.run = wandb.init(dir=run_dir, mode=mode, project=project, entity=entity, name=run_name,
                              tags=list(tags or []), group=group, job_type=job_type,
                              config=flatten(config or {}) if config else {}, reinit="create_new", settings=settings)
        self._series: dict[str, list[float]] = {k: [] for k in ("step", *CHART_SERIES)}
        self._closed = False

    @hookimpl
    def on_engine_start(self, config: dict[str, Any]) -> None:
        """Store the engine's own resolved ``EngineConfig`` next to the run config."""
        self.run.config.update(flatten({"engine_config": config}), allow_val_change=True)

    @hookimpl
    def on_step_end(self, stats: SchedulerStats) -> None:
        """Log the step's stats under ``step/<field>`` at W&B step ``stats.step``."""
        values = {f"step/{k}": v for k, v in stats.as_dict().items() if k != "step"}
        self.run.log(values, step=stats.step)
        self._series["step"].append(stats.step)
        for key in CHART_SERIES:
            self._series[key].append(float(getattr(stats, key)))

    @hookimpl
    def on_run_end(self, summary: dict[str, Any]) -> None:
        """Write the run summary (throughput, latency percentiles, ...) into ``run.summary``."""
        for key, value in summary.items():
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue
            self.run.summary[key] = value
        self._log_charts()

    def _log_charts(self) -> None:
        """KV usage and running/waiting requests over engine steps, as W&B line-series charts."""
        import wandb

        if not self._series["step"]:
            return
        xs = self._series["step"]
        for chart, keys in CHARTS.items():
            self.run.log({f"charts/{chart}": wandb.plot.line_series(
                xs=xs, ys=[self._series[k] for k in keys], keys=list(keys), title=chart, xname="engine step")})

    def close(self) -> None:
        """Finish the W&B run (flushes the offline files); safe to call twice."""
        if not self._closed:
            self._closed = True
            self.run.finish()


@hookimpl
def register_trackers(register: Register) -> None:
    """Register ``wandb``."""
    register("wandb", WandbTracker)
