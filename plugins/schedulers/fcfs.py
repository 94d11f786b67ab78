"""First-come-first-served scheduling (vLLM's default policy)."""

from __future__ import annotations

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import SchedulerPolicy


class FCFSPolicy(SchedulerPolicy):
    """Admit in arrival order; preempt the latest arrival when KV blocks run out.

    Never preempts a running request for a waiting one (work-conserving FCFS, as vLLM).
    """

    name = "fcfs"

    def key(self, request: Request) -> tuple:
        """``(arrival_time_s, seq_no)``: earliest arrival first."""
        return (request.arrival_time, request.seq_no)


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``fcfs``."""
    register("fcfs", FCFSPolicy)
