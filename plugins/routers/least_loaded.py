"""``router=least_loaded``: vLLM's data-parallel load balancer (``waiting * 4 + running``)."""

from __future__ import annotations

from collections.abc import Sequence

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.router import ReplicaState, Router, live_replicas


class LeastLoadedRouter(Router):
    """The alive replica with the lowest score ``waiting_weight * num_waiting_reqs + num_running_reqs``
    (vLLM V1's DP load balancing, ``DPLBAsyncMPClient``: waiting requests weigh 4, since each one still
    needs its prefill). Ties rotate: among equal scores the first replica after the previous choice wins,
    so an idle cluster fills evenly.

    Args:
        waiting_weight: weight of a waiting request against a running one (vLLM: 4).

    Raises:
        ValueError: a negative ``waiting_weight``.
    """

    name = "least_loaded"

    def __init__(self, seed: int = 0, waiting_weight: float = 4.0) -> None:
        super().__init__(seed)
        if waiting_weight < 0:
            raise ValueError(f"router least_loaded: waiting_weight must be >= 0, got {waiting_weight}")
        self.waiting_weight = float(waiting_weight)
        self._last = -1  # replica_id of the previous choice

    def score(self, replica: ReplicaState) -> float:
        """``waiting_weight * waiting + running``, requests (lower is better)."""
        return self.waiting_weight * replica.num_waiting_reqs + replica.num_running_reqs

    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The lowest-scoring alive replica; ties to the first one after the previous choice."""
        live = live_replicas(replicas)
        best = min(self.score(r) for r in live)
        tied = [r for r in live if self.score(r) == best]
        after = [r for r in tied if r.replica_id > self._last]
        self._last = (after or tied)[0].replica_id
        return self._last


@hookimpl
def register_routers(register: Register) -> None:
    """Register ``least_loaded``."""
    register("least_loaded", LeastLoadedRouter)
