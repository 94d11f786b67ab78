"""Priority scheduling with preemption (vLLM's ``--scheduling-policy priority``)."""

from __future__ import annotations

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import SchedulerPolicy


class PriorityPolicy(SchedulerPolicy):
    """Lower ``priority`` value is served first, ties broken by arrival (vLLM convention).

    A waiting request that outranks a running one may preempt it (recompute) when it cannot
    otherwise be admitted; the victim is always the lowest-ranked running request.
    """

    name = "priority"

    def key(self, request: Request) -> tuple:
        """``(priority, arrival_time_s, seq_no)``."""
        return (request.priority, request.arrival_time, request.seq_no)

    def may_preempt(self, candidate: Request, victim: Request) -> bool:
        """True when ``candidate`` strictly outranks ``victim``."""
        return self.key(candidate) < self.key(victim)


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``priority``."""
    register("priority", PriorityPolicy)
