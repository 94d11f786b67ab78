"""LoRA-adapter affinity: admit waiting requests whose adapter is already loaded first, one adapter's requests
together, with an aging bound so that no request starves, and without the head-of-line hold that bound used to cost.

The order, each step (the waiting queue in admission order):

1. **Aged** requests first (waited at least ``aging_s`` seconds since arrival), first come first served among them.
2. **Hot** requests next: those of the base model (they need no slot) and those whose adapter a running request
   already holds (it is in a device slot: admitting them loads nothing and never hits the ``max_loras`` limit).
3. **Cold** requests last, grouped by adapter: groups in the order of their oldest request, first come first
   served within a group. Admitting a group's first request loads its adapter; the rest of the group follows it
   while the slot is held, instead of interleaving adapters that then wait for a slot (vLLM's ``max_loras`` skip)
   or evict each other from the slots and the CPU cache.

**The slot reservation** (the aging bound). When the scheduler core finds that an aged request ``R`` cannot be
admitted because its adapter would exceed ``max_loras`` (:meth:`LoRAAffinityPolicy.wait_for_lora_slot`), ``R``
reserves the next free slot and the policy picks one loaded adapter to **drain**: the one whose running requests
finish soonest (least remaining work, ``sjf``'s estimate: uncomputed prompt plus unspent ``max_tokens``; ties: fewer
running requests, then the lower ``lora_int_id``). Until ``R`` is admitted, each step's order is

* while every slot is still held: the base model's requests and those of the *other* loaded adapters (young or
  aged, FCFS), then ``R``, which holds admission (``wait_for_lora_slot`` answers True), so the drained adapter's
  requests and the cold ones behind it wait. Loaded adapters keep serving; only the drained one admits nothing new;
* once a slot is free (an adapter that held one at the reservation runs no request any more): ``R`` first.

The first step ``R`` finds no slot also holds admission behind it (the adapter to drain is chosen then, from the
requests running at that moment, so none of its requests joins after the choice).

**Starvation bound.** No adapter enters a slot while ``R`` waits (the hot requests passing ``R`` use loaded
adapters or none; the cold ones are behind it), so the first slot to free is ``R``'s, and the drained adapter frees
one once the requests it ran at the reservation finish. The core schedules running requests before it admits any,
so each advances at least a token a step (KV and the token budget permitting, as under any policy): the drain takes
at most ``d`` steps, ``d`` being that adapter's largest remaining work in tokens (at most a prompt plus
``max_tokens``); a preempted request leaves the running set, which only frees the slot sooner. The next step ``R``
is first, and waits from then on only as ``fcfs``'s head does (KV blocks, ``max_num_seqs``). So an aged request
waits at most ``aging_s``, then one drain for each older aged request that found no slot and at most one for a
younger one whose reservation already stood (reservations are made one at a time, each to the oldest aged request
that finds no slot), then its own drain and one step.

Sources: S-LoRA (Sheng et al., MLSys 2024, Sec. 5: batch requests of loaded adapters, load others on demand);
dLoRA (Wu et al., OSDI 2024: merge requests of one adapter, bound their queueing); vLLM's scheduler, which skips a
request whose adapter would exceed ``max_loras`` (kept here for young requests); ``sjf``'s aging bound and
remaining-work estimate; the reservation is EASY backfilling's (Lifka, JSSPP 1995; Mu'alem and Feitelson, IEEE
TPDS 2001): the queue's head reserves the next free resource and later work may pass it only where it cannot delay
it, here the requests that need no new slot, with one adapter drained so that a slot does free. Preemption victims
as ``fcfs``: the latest arrival.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from plugins.schedulers._aging import AgingPolicy


def remaining_work(request: Request) -> float:
    """Tokens ``request`` may still compute: uncomputed prompt/output plus the unspent output budget (``sjf``'s
    estimate); ``inf`` without ``max_tokens`` (up to ``max_model_len``, unknown to a policy)."""
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:
        return math.inf
    return request.num_tokens - request.num_computed_tokens + max(0, max_tokens - request.num_output_tokens)


@dataclass
class SlotReservation:
    """An aged request waiting for a LoRA slot, and the loaded adapter drained to free one."""

    request: Request  # the aged request that found no slot; admitted before any other adapter enters a slot
    held: frozenset[int]  # lora_int_id of every adapter in a slot when it found none (all max_loras slots)
    draining: int  # lora_int_id of the adapter that admits nothing new until the request is admitted


class LoRAAffinityPolicy(AgingPolicy):
    """Aged requests first, then those of loaded adapters (and the base model), then the other adapters' groups;
    an aged request that finds no slot reserves one and drains one adapter while the others keep serving.

    Args:
        aging_s: waiting time after which a request outranks every non-aged one and may reserve a LoRA slot,
            seconds (``scheduler.params.aging_s``; ``inf`` disables aging and reservations).
        clock: time source on the requests' ``arrival_time`` clock (``time.perf_counter``); injectable for tests;
            an engine hands its own (``use_clock``).

    Raises:
        ValueError: ``aging_s <= 0``.
    """

    name = "lora_affinity"

    def __init__(self, aging_s: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(aging_s, clock)
        self.loaded: frozenset[int] = frozenset()  # lora_int_id of every running request's adapter (in slots)
        self.reservation: SlotReservation | None = None  # the aged request waiting for a slot, if any
        self._running: list[Request] = []  # this step's running set plus the requests admitted so far

    def observe_running(self, running: Sequence[Request]) -> None:
        """Remember the running set and its adapters: they are in device slots this step."""
        self._running = list(running)
        self.loaded = frozenset(r.lora_request.lora_int_id for r in running if r.lora_request is not None)

    def on_admitted(self, request: Request) -> None:
        """Count ``request`` in the running set; a reservation ends when its request is admitted."""
        self._running.append(request)
        if self.reservation is not None and self.reservation.request is request:
            self.reservation = None

    def key(self, request: Request) -> tuple:
        """``(tier, arrival_time_s, seq_no)`` with tier 0 aged, 1 hot (base model or loaded adapter), 2 cold;
        :meth:`sort_waiting` groups the cold ones by adapter and places a reservation's request."""
        lora = request.lora_request
        if self.aged(request):
            tier = 0
        elif lora is None or lora.lora_int_id in self.loaded:
            tier = 1
        else:
            tier = 2
        return (tier, request.arrival_time, request.seq_no)

    def sort_waiting(self, waiting: list[Request]) -> list[Request]:
        """The order of the module docstring, with one clock reading for the whole queue."""
        now = self.clock()
        queue = sorted(waiting, key=lambda r: (r.arrival_time, r.seq_no))
        reservation = self.reservation
        if reservation is not None and not any(r is reservation.request for r in queue):
            reservation = self.reservation = None  # aborted, or parked for a remote KV load
        if reservation is None:
            return self._tiers(queue, now)
        rest = [r for r in queue if r is not reservation.request]
        if reservation.held - self.loaded:  # a slot is free; no request ahead of this one could have taken it
            return [reservation.request, *self._tiers(rest, now)]
        passing, behind = [], []
        for request in rest:  # the base model's and the undrained loaded adapters' requests pass it
            lora = request.lora_request
            ok = lora is None or (lora.lora_int_id in self.loaded and lora.lora_int_id != reservation.draining)
            (passing if ok else behind).append(request)
        return [*passing, reservation.request, *self._tiers(behind, now)]

    def _tiers(self, queue: list[Request], now: float) -> list[Request]:
        """Aged, hot, then cold grouped by adapter (groups by their oldest request); ``queue`` in arrival order."""
        aged, hot, cold = [], [], {}
        for request in queue:
            lora = request.lora_request
            if self.aged(request, now):
                aged.append(request)
            elif lora is None or lora.lora_int_id in self.loaded:
                hot.append(request)
            else:  # dicts keep insertion order: groups by their oldest request
                cold.setdefault(lora.lora_int_id, []).append(request)
        return aged + hot + [r for group in cold.values() for r in group]

    def wait_for_lora_slot(self, request: Request) -> bool:
        """True for an aged request (it reserves the next free slot and holds admission behind it; the first call
        picks the adapter to drain); False for a young one (vLLM's skip) or while another request's reservation
        stands (its turn comes after that one's)."""
        if request.lora_request is None or not self.aged(request):
            return False
        reservation = self.reservation
        if reservation is not None and reservation.request is not request:
            return False
        slots = {r.lora_request.lora_int_id for r in self._running if r.lora_request is not None}
        if not slots:  # no adapter holds a slot, so none can be drained (the core never asks then)
            return False
        if reservation is None or reservation.draining not in slots:
            self.reservation = SlotReservation(request, frozenset(slots), self._soonest_to_drain())
        return True

    def _soonest_to_drain(self) -> int:
        """The running adapter whose requests finish soonest: least largest remaining work, then fewest running
        requests, then the lowest ``lora_int_id``."""
        by_adapter: dict[int, list[Request]] = {}
        for request in self._running:
            if request.lora_request is not None:
                by_adapter.setdefault(request.lora_request.lora_int_id, []).append(request)
        return min(by_adapter, key=lambda i: (max(map(remaining_work, by_adapter[i])), len(by_adapter[i]), i))

    def select_victim(self, running: list[Request]) -> Request:
        """The latest arrival (``fcfs``'s victim)."""
        return max(running, key=lambda r: (r.arrival_time, r.seq_no))


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``lora_affinity``."""
    register("lora_affinity", LoRAAffinityPolicy)
