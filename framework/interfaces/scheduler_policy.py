"""Scheduler policy: waiting-queue order, admission and preemption victim."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    from framework.core.request import Request


class SchedulerPolicy(Plugin, ABC):
    """Decides *who* goes first; the scheduler core (``framework.core.scheduler``) decides *how much*.

    The core re-ranks the waiting queue with :meth:`sort_waiting` (default: by :meth:`key`) at the
    start of every step, so keys may change over time (aging, prefix-cache state); it admits from
    the head and, when the KV allocator cannot give a running request its slots, preempts
    :meth:`select_victim` (recompute: its blocks are freed and it re-enters the waiting queue).
    Policies never own blocks: :meth:`attach` hands them a read-only prefix-cache lookup.
    """

    def __init__(self, **params: Any) -> None:
        if params:
            raise TypeError(f"scheduler policy {self.name!r} takes no parameters, got {sorted(params)}")
        self.num_cached_prefix_tokens: Callable[[Request], int] = lambda request: 0

    def attach(self, num_cached_prefix_tokens: Callable[[Request], int]) -> None:
        """Receive the scheduler's read-only prefix-cache lookup (tokens a prefix hit would serve now).

        Called once by the scheduler core at construction; the callable changes no allocator state.
        """
        self.num_cached_prefix_tokens = num_cached_prefix_tokens

    def use_clock(self, now: Callable[[], float]) -> None:
        """Receive the run's time source (seconds, the clock of ``Request.arrival_time``: wall time, or
        a simulator's virtual time), for policies whose keys depend on time (``sjf`` aging).

        Called once by the scheduler core at construction when the engine passes its clock. Default:
        stored as ``self.clock``.
        """
        self.clock = now

    def sort_waiting(self, waiting: list[Request]) -> list[Request]:
        """The waiting queue in admission order (head first); must return the same requests.

        Called by the scheduler core at the start of every step. Default: ascending
        ``(key(request), seq_no)``.
        """
        return sorted(waiting, key=lambda r: (self.key(r), r.seq_no))

    def observe_running(self, running: Sequence[Request]) -> None:
        """The running requests at the start of a step, before :meth:`sort_waiting` (read-only: do not mutate
        the list or its requests), for policies that rank by what runs now (``lora_affinity``: the running set's
        LoRA adapters are the ones in device slots). Called by the scheduler core every step; default: ignored.
        """

    def wait_for_lora_slot(self, request: Request) -> bool:
        """Whether admission stops this step at waiting ``request``, whose LoRA adapter would exceed
        ``max_loras`` distinct adapters in the running set.

        Called by the scheduler core during admission, in :meth:`sort_waiting`'s order, only with LoRA on. False
        (default): ``request`` is skipped this step and the requests behind it may still be admitted (vLLM's
        rule). True: nothing behind it is admitted this step, so running adapters drain and ``request`` gets a
        slot (a starvation bound: ``lora_affinity`` answers True for a request waiting longer than ``aging_s``).
        Must not mutate the request.
        """
        return False

    def on_admitted(self, request: Request) -> None:
        """Notification that ``request`` left the waiting queue for the running batch (fair-share
        bookkeeping). Called by the scheduler core; default does nothing."""

    @abstractmethod
    def key(self, request: Request) -> tuple:
        """Sort key of the waiting queue; the smallest key is admitted first.

        Called by :meth:`sort_waiting` every step (so it may depend on time or cache state) and by
        :meth:`select_victim`. Must not mutate the request.
        """

    def select_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when KV blocks run out.

        Called by the scheduler core with the non-empty list of running requests, in admission
        order. The default preempts the request with the largest ``(key, seq_no)``: ties go to the
        latest arrival, so two equal requests cannot keep preempting each other (livelock).
        """
        return max(running, key=lambda r: (self.key(r), r.seq_no))

    def may_preempt(self, candidate: Request, victim: Request) -> bool:
        """Whether waiting ``candidate`` may evict running ``victim`` to be admitted.

        Called by the scheduler core at the start of a step when the head of the waiting queue
        cannot be admitted (no free sequence slot or not enough KV blocks). Default: never
        (work-conserving FCFS behaviour).
        """
        return False
