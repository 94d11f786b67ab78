"""W&B tracker: offline runs write under <run_dir>/wandb with no network; disabled writes nothing."""

from __future__ import annotations

import pytest

from framework import registry
from framework.core.outputs import SchedulerStats
from plugins.trackers.wandb import WandbTracker


def _stats(step: int) -> SchedulerStats:
    return SchedulerStats(step=step, num_running_reqs=2, num_waiting_reqs=1, num_scheduled_tokens=9,
                          num_prefill_tokens=8, num_decode_tokens=1, kv_cache_usage=0.25, prefix_cache_hit_rate=0.5,
                          num_preemptions=0, step_s=0.01)


def _drive(tracker: WandbTracker) -> None:
    """Call the hooks the way a run does, through the plugin manager."""
    with registry.registered(tracker):
        hook = registry.plugin_manager().hook
        hook.on_engine_start(config={"model": "stories260K", "max_num_seqs": 4})
        for step in range(3):
            hook.on_step_end(stats=_stats(step))
        hook.on_run_end(summary={"request_throughput": 2.5, "mean_ttft_ms": 12.0, "request_goodput": None})
    if tracker.run.settings.mode != "disabled":
        assert tracker.run.summary["request_throughput"] == 2.5
        assert "request_goodput" not in tracker.run.summary.keys()  # None values are skipped
    tracker.close()
    tracker.close()  # idempotent


def test_registered_as_wandb():
    assert registry.get_class("tracker", "wandb") is WandbTracker
    assert "none" in registry.choices("tracker")


def test_offline_run_writes_files(tmp_path):
    tracker = registry.create("tracker", "wandb", run_dir=str(tmp_path), config={"seed": 0}, mode="offline",
                              project="servelab-test")
    assert tracker.run.config["seed"] == 0
    _drive(tracker)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb")), "the offline run file holds the logged steps and summary"


def test_disabled_mode_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    _drive(WandbTracker(run_dir=str(run_dir), mode="disabled"))
    assert not run_dir.exists() or not any(run_dir.rglob("*"))


def test_bad_mode_and_unknown_param(tmp_path):
    with pytest.raises(ValueError, match="offline"):
        WandbTracker(run_dir=str(tmp_path), mode="cloud")
    with pytest.raises(TypeError, match="projekt"):
        WandbTracker(run_dir=str(tmp_path), mode="disabled", projekt="x")


def test_config_is_flattened_and_group_and_charts_are_logged(tmp_path):
    tracker = registry.create("tracker", "wandb", run_dir=str(tmp_path), mode="offline", project="servelab-test",
                              config={"scheduler": {"name": "fcfs"}, "engine": {"max_num_seqs": 8}},
                              group="2026-01-01_12-00-00", job_type="ablation")
    assert tracker.run.config["scheduler.name"] == "fcfs" and tracker.run.config["engine.max_num_seqs"] == 8
    assert tracker.run.group == "2026-01-01_12-00-00" and tracker.run.job_type == "ablation"
    _drive(tracker)
    assert tracker._series["step"] == [0, 1, 2] and tracker._series["num_waiting_reqs"] == [1.0, 1.0, 1.0]


def test_register_trackers_hookimpl_registers_wandb():
    from plugins.trackers import wandb as module

    seen = []
    module.register_trackers(register=lambda name, cls: seen.append((name, cls)))
    assert seen == [("wandb", WandbTracker)]
