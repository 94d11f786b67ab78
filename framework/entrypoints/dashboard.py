"""Live terminal dashboard of a running engine (``ui=dashboard``), nano-vllm's idea on real engine state.

Fed only by the lifecycle hooks (``on_step_end``, ``on_request_finished``); rich ``Live`` re-renders it
a few times per second: waiting / running / preempted requests, a KV-block usage bar, the prefix-cache
hit rate, output tok/s (over the last ``window`` steps) and the per-step time split.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from framework.hookspecs import hookimpl

PARTS = ("schedule_s", "prepare_s", "forward_s", "sample_s", "update_s")


class Dashboard:
    """A pluggy observer rendering engine state; use as a context manager around the run.

    Args:
        total_requests: requests in the workload (for the finished counter), or ``None``.
        window: steps averaged for tok/s and the time split.
        console: rich console to draw on (default: a new one on stderr).
    """

    def __init__(self, total_requests: int | None = None, window: int = 50, console: Console | None = None) -> None:
        self.total_requests = total_requests
        self.steps: deque[Any] = deque(maxlen=window)
        self.last: Any = None
        self.num_preempted = 0  # cumulative preemptions, requests
        self.num_finished = 0
        self.t0 = time.perf_counter()
        self._live = Live(self, console=console or Console(stderr=True), refresh_per_second=4, transient=False)

    def __enter__(self) -> Dashboard:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.__exit__(*exc)

    @hookimpl
    def on_step_end(self, stats: Any) -> None:
        """Record one step's ``SchedulerStats``."""
        self.last = stats
        self.steps.append(stats)
        self.num_preempted += stats.num_preemptions

    @hookimpl
    def on_request_finished(self, output: Any) -> None:
        """Count a finished request."""
        self.num_finished += 1

    def tokens_per_s(self) -> float:
        """Output tokens per second of engine step time over the window."""
        busy = sum(s.step_s for s in self.steps)
        return sum(s.num_generated_tokens for s in self.steps) / busy if busy > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        """Fraction of step time in each part over the window (schedule, prepare, forward, sample, update)."""
        total = sum(s.step_s for s in self.steps)
        return {p.removesuffix("_s"): (sum(getattr(s, p) for s in self.steps) / total if total > 0 else 0.0)
                for p in PARTS}

    def __rich__(self) -> Group:
        s = self.last
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        done = f"{self.num_finished}" + (f"/{self.total_requests}" if self.total_requests else "")
        table.add_row("step", f"{s.step if s else '-'}   elapsed {time.perf_counter() - self.t0:.1f} s   finished {done}")
        table.add_row("requests", f"waiting {s.num_waiting_reqs if s else 0}   running {s.num_running_reqs if s else 0}"
                                  f"   preempted {self.num_preempted}")
        usage = s.kv_cache_usage if s else 0.0
        table.add_row("KV blocks", Group(ProgressBar(total=1.0, completed=usage, width=40), f"{usage:.1%} in use"))
        table.add_row("prefix hit", f"{(s.prefix_cache_hit_rate if s else 0.0):.1%}")
        table.add_row("output tok/s", f"{self.tokens_per_s():.1f}")
        table.add_row("step split", "  ".join(f"{k} {v:.0%}" for k, v in self.time_split().items()))
        return Group(table)
