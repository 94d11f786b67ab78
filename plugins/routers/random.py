"""``router=random``: a uniformly random alive replica."""

from __future__ import annotations

from collections.abc import Sequence

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.router import ReplicaState, Router, live_replicas


class RandomRouter(Router):
    """Each request to an alive replica drawn uniformly from the router's seeded RNG (SGLang's ``random``
    policy); the baseline every load- or cache-aware router must beat."""

    name = "random"

    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """A uniform draw over the alive replicas."""
        return self.rng.choice(live_replicas(replicas)).replica_id


@hookimpl
def register_routers(register: Register) -> None:
    """Register ``random``."""
    register("random", RandomRouter)
