"""Scheduler policy: waiting-queue order, admission and preemption victim."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    from framework.request import Request


class SchedulerPolicy(Plugin, ABC):
    """Decides *who* goes first; the scheduler core (``framework.scheduler``) decides *how much*.

    The core keeps the waiting queue sorted by :meth:`key`, admits from its head, and, when the
    KV allocator cannot give a running request its slots, preempts :meth:`select_victim`
    (recompute: its blocks are freed and it re-enters the waiting queue).
    """

    def __init__(self, **params: Any) -> None:
        if params:
            raise TypeError(f"scheduler policy {self.name!r} takes no parameters, got {sorted(params)}")

    @abstractmethod
    def key(self, request: Request) -> tuple:
        """Sort key of the waiting queue; the smallest key is admitted first.

        Called by the scheduler whenever a request enters the waiting queue. Must not mutate.
        """

    def select_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out.

        Called by the scheduler core with the non-empty list of running requests, in admission
        order. The default preempts the request with the largest :meth:`key`.
        """
        return max(running, key=self.key)

    def may_preempt(self, candidate: Request, victim: Request) -> bool:
        """Whether waiting ``candidate`` may evict running ``victim`` to be admitted.

        Called by the scheduler core at the start of a step when the head of the waiting queue
        cannot be admitted (no free sequence slot or not enough KV blocks). Default: never
        (work-conserving FCFS behaviour).
        """
        return False
