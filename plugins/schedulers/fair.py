"""Round-robin fair share across clients (``Request.client_id``), in the spirit of the Virtual Token
Counter (Sheng et al. 2024, "Fairness in Serving Large Language Models", OSDI'24) at request grain.

The waiting queue is interleaved by client: one request per client in turn, starting with the
client admitted least recently, FCFS within a client. A client flooding the queue therefore gets
one admission per round like everyone else. Requests without a ``client_id`` share one client.
Under KV pressure the victim is the latest arrival of the client holding the most running requests.
"""

from __future__ import annotations

import itertools
from collections import Counter

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import SchedulerPolicy


class FairPolicy(SchedulerPolicy):
    """Interleave clients round-robin; preempt from the client with the most running requests."""

    name = "fair"

    def __init__(self) -> None:
        super().__init__()
        self._last_admitted: dict[str | None, int] = {}  # client -> admission counter value
        self._counter = itertools.count(1)

    def key(self, request: Request) -> tuple:
        """``(arrival_time_s,)``: FCFS within one client."""
        return (request.arrival_time,)

    def sort_waiting(self, waiting: list[Request]) -> list[Request]:
        """Round-robin over clients (least recently admitted client first), FCFS within each."""
        by_client: dict[str | None, list[Request]] = {}
        for request in sorted(waiting, key=lambda r: (self.key(r), r.seq_no)):
            by_client.setdefault(request.client_id, []).append(request)
        clients = sorted(by_client, key=lambda c: (self._last_admitted.get(c, 0), by_client[c][0].seq_no))
        order: list[Request] = []
        for round_ in itertools.zip_longest(*(by_client[c] for c in clients)):
            order.extend(r for r in round_ if r is not None)
        return order

    def on_admitted(self, request: Request) -> None:
        """Remember when the request's client was last served."""
        self._last_admitted[request.client_id] = next(self._counter)

    def select_victim(self, running: list[Request]) -> Request:
        """Latest arrival of the client with the most running requests."""
        load = Counter(r.client_id for r in running)
        return max(running, key=lambda r: (load[r.client_id], r.arrival_time, r.seq_no))


@hookimpl
def register_schedulers(register: Register) -> None:
    """Register ``fair``."""
    register("fair", FairPolicy)
