"""Shortest-job-first with aging: the least remaining work is admitted first, and nothing starves.

Remaining work is known up to the output length, so the estimate is the uncomputed prompt plus
the output budget: ``num_tokens - num_computed_tokens + max_tokens - num_output_tokens`` tokens
(the SJF/SRPT estimate used when output lengths are unknown, cf. Fu et al. 2024, "Efficient LLM
Scheduling by Learning to Rank", Sec. 2). Aging bounds starvation: a request that has waited at
least ``aging_s`` seconds since arrival is ranked ahead of every younger one, first come first
served among the aged, so once aged it waits at most for the aged requests that arrived before it.
"""

from __future__ import annotations

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from plugins.schedulers._aging import AgingPolicy


class SJFPolicy(AgingPolicy):
    """Shortest remaining work first; requests older than ``aging_s`` go first, FCFS among them.

    Args:
        aging_s: waiting time after which a request outranks all non-aged ones, seconds
            (``scheduler.params.aging_s``; ``inf`` disables aging).
        clock: time source on the requests' ``arrival_time`` clock (``time.perf_counter``);
            injectable for tests; an engine hands its own (``use_clock``: wall or simulated time).

    Raises:
        ValueError: ``aging_s <= 0``.
    """

    name = "sjf"

    @staticmethod
    def remaining_work(request: Request) -> int:
        """Estimated tokens still to compute: uncomputed prompt/output plus the remaining output budget."""
        params = request.sampling_params
        return (request.num_tokens - request.num_computed_tokens
                + max(0, params.max_tokens - request.num_output_tokens))

    def key(self, request: Request) -> tuple:
        """``(0, arrival)`` once aged, else ``(1, remaining_work, arrival)``."""
        if self.aged(request):
            return (0, request.arrival_time, 0)
        return (1, self.remaining_work(request), request.arrival_time)

    def sort_waiting(self, waiting: list[Request]) -> list[Request]:
        """Rank by :meth:`key` with one clock reading for the whole queue."""
        now = self.clock()
        clock, self.clock = self.clock, lambda: now
        try:
            return super().sort_waiting(waiting)
        finally:
            self.clock = clock


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``sjf``."""
    register("sjf", SJFPolicy)
