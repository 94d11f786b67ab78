"""``router=round_robin``: replicas in turn, skipping dead ones."""

from __future__ import annotations

from collections.abc import Sequence

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.router import ReplicaState, Router, live_replicas


class RoundRobinRouter(Router):
    """The next alive replica after the previous choice (in ``replica_id`` order, wrapping around); load
    and prompt are ignored. Spreads requests evenly by count whatever their size."""

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._last = -1  # replica_id of the previous choice

    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The first alive replica whose id is greater than the previous choice's, else the first alive one."""
        live = live_replicas(replicas)
        after = [r for r in live if r.replica_id > self._last]
        self._last = (after or live)[0].replica_id
        return self._last


@hookimpl
def register_routers(register: Register) -> None:
    """Register ``round_robin``."""
    register("round_robin", RoundRobinRouter)
