"""Data-parallel replicas behind one front: which replica holds each request, which replicas still serve, and the
router plugin that places new requests (the bookkeeping of vLLM's DP coordinator and SGLang's router).

One :class:`ReplicaSet` serves both fronts: :class:`~framework.engine.data_parallel.DataParallelEngine` (replicas
built in this process, stepped by ``LLM`` and the offline runner) and :class:`~framework.engine.async_llm.AsyncLLM`
(engine cores behind clients, the server). The fronts differ only in how they reach a replica (a method call, a
ZMQ message) and where its load comes from (read now, or the core's last publication); routing, placement, the
router's notifications and the dead-replica rule are here, once.

Thread safety: none; each front calls it under its own lock or from its single loop thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from framework.core.faults import EngineDeadError
from framework.interfaces.router import ReplicaState, Router

logger = logging.getLogger(__name__)


class ReplicaSet:
    """``num_replicas`` replicas and a router.

    Args:
        num_replicas: replicas behind the front (>= 1).
        router: the router plugin (``framework.interfaces.Router``); ``None`` only with one replica (nothing to
            choose).
        router_name: how errors name the router (``config.router``).
        roles: each replica's role (``prefill``, ``decode``, ``both``; :attr:`ReplicaState.role`), default all
            ``both``; P/D disaggregation (``disagg.prefill_replicas``) gives its pools.

    Raises:
        ValueError: several replicas and no router; ``roles`` of another length or with an unknown role.
    """

    def __init__(self, num_replicas: int, router: Router | None, router_name: str = "",
                 roles: Sequence[str] | None = None) -> None:
        if num_replicas > 1 and router is None:
            raise ValueError("several data-parallel replicas need a router (router=NAME)")
        self.roles = list(roles) if roles is not None else ["both"] * num_replicas
        if len(self.roles) != num_replicas or not set(self.roles) <= {"prefill", "decode", "both"}:
            raise ValueError(f"roles must be one of prefill, decode, both per replica ({num_replicas}), got {roles!r}")
        self.router = router
        self.router_name = router_name or getattr(router, "name", "") or "router"
        self.alive = [True] * num_replicas
        self.num_routed = [0] * num_replicas  # requests placed on each replica so far
        self.where: dict[str, int] = {}  # in-flight request id -> its replica

    def __len__(self) -> int:
        return len(self.alive)

    def live(self) -> list[int]:
        """Indexes of the replicas still serving."""
        return [i for i, ok in enumerate(self.alive) if ok]

    @property
    def disaggregated(self) -> bool:
        """True when some replicas only prefill (P/D disaggregation): each request runs in two phases."""
        return "prefill" in self.roles

    def choose(self, request_id: str, token_ids: Sequence[int], states: Sequence[ReplicaState],
               role: str | None = None) -> int:
        """The replica for a new request: the router's choice given every replica's ``states`` (dead ones
        ``alive=False``); with one replica, replica 0 without asking. ``role``: the phase's role (``prefill`` or
        ``decode``), chosen by :meth:`Router.route_role` among the replicas of that role; ``None``: any replica.

        Raises:
            ValueError: ``request_id`` is in flight already.
            EngineDeadError: no replica is alive.
            RuntimeError: the router chose a replica that does not exist or is dead (a router bug).
        """
        if request_id in self.where:
            raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
        if not any(self.alive):
            raise EngineDeadError("every data-parallel replica is dead; build a new engine")
        if len(self.alive) == 1:
            return 0
        if role is None:
            choice = self.router.route(request_id, list(token_ids), list(states))
        else:
            states = [dataclasses.replace(s, role=self.roles[s.replica_id]) for s in states]
            choice = self.router.route_role(role, request_id, list(token_ids), states)
        if not (isinstance(choice, int) and 0 <= choice < len(self.alive) and self.alive[choice]
                and (role is None or self.roles[choice] in (role, "both"))):
            raise RuntimeError(f"router {self.router_name!r} chose replica {choice!r}, which is not an alive "
                               f"{role or 'serving'} one")
        return choice

    def place(self, request_id: str, replica: int) -> None:
        """Record that ``replica`` holds ``request_id`` now."""
        self.where[request_id] = replica
        self.num_routed[replica] += 1

    def refused(self, request_id: str, replica: int) -> None:
        """``replica`` refused a request :meth:`choose` placed there (not yet :meth:`place`\\ d): the router forgets
        it."""
        if self.router is not None and len(self.alive) > 1:
            self.router.on_request_finished(request_id, replica)

    def finish(self, request_id: str) -> int | None:
        """``request_id`` finished (or failed, or was aborted): forget where it ran and tell the router; returns
        its replica (``None``: not in flight here)."""
        replica = self.where.pop(request_id, None)
        if replica is not None and self.router is not None and len(self.alive) > 1:
            self.router.on_request_finished(request_id, replica)
        return replica

    def held_by(self, replica: int) -> list[str]:
        """The in-flight request ids ``replica`` holds."""
        return [rid for rid, i in self.where.items() if i == replica]

    def remove(self, replica: int, reason: str) -> list[str]:
        """``replica`` died of ``reason``: it is never chosen again and the router is told; returns the request
        ids it held (forgotten here: the caller fails each with :meth:`died_error`). Logs which replicas keep
        serving."""
        if not self.alive[replica]:
            return []
        self.alive[replica] = False
        held = self.held_by(replica)
        for rid in held:
            self.where.pop(rid)
        if self.router is not None and len(self.alive) > 1:
            self.router.on_replica_removed(replica)
        if any(self.alive):
            logger.error("data-parallel replica %d died (%s); its in-flight requests fail, replicas %s keep serving",
                         replica, reason, self.live())
        return held

    def died_error(self, replica: int, reason: str) -> str:
        """The error of a request whose replica died: retryable while other replicas serve (HTTP 503
        ``engine_dead``), else the front is dead with it."""
        if any(self.alive):
            return f"data-parallel replica {replica} died ({reason}); retry the request: the other replicas serve"
        return f"data-parallel replica {replica} died ({reason}), the last one serving; build a new engine"
