"""Router: which data-parallel replica serves a request (``parallel.data_parallel_size=N``, ``router=NAME``).

The front (``framework.engine.data_parallel``) holds one :class:`ReplicaState` per replica: the load each
replica publishes after every step (and at least every 100 ms while it runs), plus the requests the front
routed to it since that publication (vLLM's DP load balancer counts them the same way, so a burst of
arrivals between two publications does not herd onto one replica). For each new request it calls
:meth:`Router.route` with the request's prompt token ids and every replica's state, dead ones included
(``alive=False``): a router must never choose a dead replica.

P/D disaggregation (``disagg.prefill_replicas=P``): each replica has a role (:attr:`ReplicaState.role`:
``prefill``, ``decode``, or ``both`` when colocated) and the front asks :meth:`Router.route_role` for a replica of
the role a request's phase needs; it shows the router the other replicas as not alive, so every router learns the
roles through the one rule it already keeps (never choose a dead replica), and its history (a rotation, routed
prefixes) follows what it chose in each pool.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from framework.interfaces.base import Plugin


class NoReplicaError(RuntimeError):
    """Every replica is dead: nothing can serve the request (the front fails it, 503 on a server)."""


@dataclass(frozen=True)
class ReplicaState:
    """One replica's load as the front sees it when routing a request."""

    replica_id: int  # index of the replica, 0 .. data_parallel_size - 1
    num_waiting_reqs: int = 0  # requests queued on the replica (last publication + routed since), requests
    num_running_reqs: int = 0  # requests in the replica's running batch at its last publication, requests
    kv_cache_usage: float = 0.0  # fraction of the replica's KV blocks in use at its last publication, [0, 1]
    alive: bool = True  # False once the replica died (its engine core exited or its step failed)
    published_s: float = 0.0  # when the replica last published, seconds on the front's clock
    role: str = "both"  # prefill | decode (disagg.prefill_replicas > 0) | both: serves whole requests

    @property
    def load(self) -> int:
        """Requests in flight on the replica (waiting + running): the load SGLang's router balances."""
        return self.num_waiting_reqs + self.num_running_reqs


def live_replicas(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas a request may go to (``alive``), in ``replica_id`` order.

    Raises:
        NoReplicaError: none is alive.
    """
    live = sorted((r for r in replicas if r.alive), key=lambda r: r.replica_id)
    if not live:
        raise NoReplicaError(f"all {len(replicas)} data-parallel replicas are dead; restart the engine")
    return live


class Router(Plugin, ABC):
    """Picks the replica for each request; may keep its own history (routed prefixes, a rotation).

    Args:
        seed: seed of :attr:`rng`, the router's only source of randomness (the front passes the run's
            ``seed``), so a run's routing is reproducible.
        params: ``router.params`` of the config group; a router that takes none refuses any.

    Raises:
        TypeError: an unknown parameter.
    """

    def __init__(self, seed: int = 0, **params: Any) -> None:
        if params:
            raise TypeError(f"router {self.name!r} takes no parameters, got {sorted(params)}")
        self.rng = random.Random(seed)

    @abstractmethod
    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The ``replica_id`` of the replica that serves this request.

        Called by the front once per request (an ``n > 1`` request once for all its sequences), before the
        request reaches any replica, with every replica's state, in ``replica_id`` order, at least one alive.
        May update the router's history (it is the only call that learns where a request went). Must not
        mutate its arguments.

        Args:
            prompt_token_ids: the prompt, token ids (after the chat template and tokenization).
            replicas: every replica's state, dead ones with ``alive=False``.

        Returns:
            The id of an alive replica.
        """

    def route_role(self, role: str, request_id: str, prompt_token_ids: Sequence[int],
                   replicas: Sequence[ReplicaState]) -> int:
        """The ``replica_id`` of a replica of ``role`` (or ``both``) for this request: :meth:`route` over
        ``replicas`` with every replica of another role shown as not alive.

        Called by a P/D front (``disagg.prefill_replicas > 0``) once per phase of a request: ``prefill`` (its
        prompt, one output token), then ``decode``. A router needs nothing of its own for it (the rule lives here,
        once); one that routes by role otherwise may override it.

        Raises:
            NoReplicaError: no alive replica has that role (all of that pool died).
        """
        if not any(r.alive and r.role in (role, "both") for r in replicas):
            raise NoReplicaError(f"no alive {role} replica among {len(replicas)} (every one of the {role} pool "
                                 "died); restart the server")
        return self.route(request_id, prompt_token_ids,
                          [r if r.role in (role, "both") else replace(r, alive=False) for r in replicas])

    def on_request_finished(self, request_id: str, replica_id: int) -> None:
        """The request routed to ``replica_id`` finished (stopped, aborted or failed). Called by the front
        once per routed request; default does nothing."""

    def on_replica_removed(self, replica_id: int) -> None:
        """The replica died and will never be chosen again: forget what is known about it (its routed
        prefixes). Called by the front once, when it sees the replica dead; default does nothing."""
