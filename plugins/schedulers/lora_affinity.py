"""LoRA-adapter affinity: admit waiting requests whose adapter is already loaded first, one adapter's requests
together, with an aging bound so that no request starves.

The rule, each step (the waiting queue in admission order):

1. **Aged** requests first (waited at least ``aging_s`` seconds since arrival), first come first served among them.
   When an aged request's adapter would exceed ``max_loras`` distinct adapters in the running set, admission
   stops there for the step (:meth:`LoRAAffinityPolicy.wait_for_lora_slot`): nothing behind it joins, the
   running requests' adapters drain as they finish, and it gets a slot. So a request waits at most ``aging_s``
   plus the time the requests running then need to finish (each bounded by its ``max_tokens``), plus the aged
   requests that arrived before it.
2. **Hot** requests next: those of the base model (they need no slot) and those whose adapter a running request
   already holds (it is in a device slot: admitting them loads nothing and never hits the ``max_loras`` limit).
3. **Cold** requests last, grouped by adapter: groups in the order of their oldest request, first come first
   served within a group. Admitting a group's first request loads its adapter; the rest of the group follows it
   while the slot is held, instead of interleaving adapters that then wait for a slot (vLLM's ``max_loras`` skip)
   or evict each other from the slots and the CPU cache.

Sources: S-LoRA (Sheng et al., MLSys 2024, Sec. 5: batch requests of loaded adapters, load others on demand);
dLoRA (Wu et al., OSDI 2024: merge requests of one adapter, bound their queueing); vLLM's scheduler, which skips a
request whose adapter would exceed ``max_loras`` (kept here as the default for young requests). The aging bound is
the one ``sjf`` uses. Preemption victims as ``fcfs``: the latest arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from plugins.schedulers._aging import AgingPolicy


class LoRAAffinityPolicy(AgingPolicy):
    """Aged requests first, then those of loaded adapters (and the base model), then the other adapters' groups.

    Args:
        aging_s: waiting time after which a request outranks every non-aged one and holds admission until its
            adapter gets a slot, seconds (``scheduler.params.aging_s``; ``inf`` disables aging).
        clock: time source on the requests' ``arrival_time`` clock (``time.perf_counter``); injectable for tests;
            an engine hands its own (``use_clock``).

    Raises:
        ValueError: ``aging_s <= 0``.
    """

    name = "lora_affinity"

    def __init__(self, aging_s: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(aging_s, clock)
        self.loaded: frozenset[int] = frozenset()  # lora_int_id of every running request's adapter (in slots)

    def observe_running(self, running: Sequence[Request]) -> None:
        """Remember the running set's adapters: they are in device slots this step."""
        self.loaded = frozenset(r.lora_request.lora_int_id for r in running if r.lora_request is not None)

    def key(self, request: Request) -> tuple:
        """``(tier, arrival_time_s, seq_no)`` with tier 0 aged, 1 hot (base model or loaded adapter), 2 cold;
        :meth:`sort_waiting` groups the cold ones by adapter."""
        lora = request.lora_request
        if self.aged(request):
            tier = 0
        elif lora is None or lora.lora_int_id in self.loaded:
            tier = 1
        else:
            tier = 2
        return (tier, request.arrival_time, request.seq_no)

    def sort_waiting(self, waiting: list[Request]) -> list[Request]:
        """The rule of the module docstring, with one clock reading for the whole queue."""
        now = self.clock()
        aged, hot, cold = [], [], {}
        for request in sorted(waiting, key=lambda r: (r.arrival_time, r.seq_no)):
            lora = request.lora_request
            if self.aged(request, now):
                aged.append(request)
            elif lora is None or lora.lora_int_id in self.loaded:
                hot.append(request)
            else:  # dicts keep insertion order: groups by their oldest request
                cold.setdefault(lora.lora_int_id, []).append(request)
        return aged + hot + [r for group in cold.values() for r in group]

    def wait_for_lora_slot(self, request: Request) -> bool:
        """True for an aged request: admission stops until its adapter gets a slot (the starvation bound)."""
        return self.aged(request)

    def select_victim(self, running: list[Request]) -> Request:
        """The latest arrival (``fcfs``'s victim)."""
        return max(running, key=lambda r: (r.arrival_time, r.seq_no))


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``lora_affinity``."""
    register("lora_affinity", LoRAAffinityPolicy)
