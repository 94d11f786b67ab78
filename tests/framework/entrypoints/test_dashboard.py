"""ui=dashboard: the rich dashboard is fed by the lifecycle hooks and renders real engine numbers."""

from __future__ import annotations

import io

from rich.console import Console

from framework import registry
from framework.core.outputs import SchedulerStats
from framework.entrypoints.dashboard import Dashboard


def _stats(step: int) -> SchedulerStats:
    return SchedulerStats(step=step, num_running_reqs=3, num_waiting_reqs=5, num_scheduled_tokens=10,
                          num_prefill_tokens=7, num_decode_tokens=3, kv_cache_usage=0.5, prefix_cache_hit_rate=0.25,
                          num_preemptions=1, schedule_s=0.01, forward_s=0.08, sample_s=0.01, step_s=0.1,
                          num_generated_tokens=4)


def test_dashboard_tracks_hooks_and_renders():
    out = io.StringIO()
    dashboard = Dashboard(total_requests=7, console=Console(file=out, width=120, force_terminal=False))
    with dashboard, registry.registered(dashboard):
        hook = registry.plugin_manager().hook
        for step in range(4):
            hook.on_step_end(stats=_stats(step))
    assert dashboard.num_preempted == 4 and abs(dashboard.tokens_per_s() - 40.0) < 1e-9
    split = dashboard.time_split()
    assert abs(split["forward"] - 0.8) < 1e-9 and abs(sum(split.values()) - 1.0) < 1e-9
    text = out.getvalue()
    assert "waiting 5" in text and "running 3" in text and "preempted 4" in text and "25.0%" in text
    assert "50.0% in use" in text and "forward 80%" in text
