"""Longest-prefix-match first (SGLang's cache-aware ``lpm`` policy, Zheng et al. 2024, "SGLang", Sec. 3).

Waiting requests whose prompt shares the longest prefix with what the KV cache holds *now* are
admitted first, ties by arrival: reusing a cached prefix before it is evicted raises the hit rate
(the paper's "cache-aware scheduling"). The match length comes from the scheduler's read-only
prefix lookup, so the ranking follows the cache as it changes step by step.
"""

from __future__ import annotations

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import SchedulerPolicy


class LPMPolicy(SchedulerPolicy):
    """Most cached prefix tokens first, then earliest arrival; victim: the latest arrival."""

    name = "lpm"

    def key(self, request: Request) -> tuple:
        """``(-cached_prefix_tokens, arrival_time_s)`` for waiting requests."""
        return (-self.num_cached_prefix_tokens(request), request.arrival_time)

    def select_victim(self, running: list[Request]) -> Request:
        """Preempt the latest arrival (the prefix match of a running request is not meaningful)."""
        return max(running, key=lambda r: (r.arrival_time, r.seq_no))


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``lpm``."""
    register("lpm", LPMPolicy)
