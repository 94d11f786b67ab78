"""``router=power_of_two``: two random replicas, the less loaded one wins."""

from __future__ import annotations

from collections.abc import Sequence

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.router import ReplicaState, Router, live_replicas


class PowerOfTwoRouter(Router):
    """The power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing",
    IEEE TPDS 2001; SGLang's ``power_of_two`` policy): draw two distinct alive replicas, send the request
    to the one with fewer requests in flight (``waiting + running``), ties to the lower KV-cache usage,
    then to the first drawn. With one alive replica, that one."""

    name = "power_of_two"

    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """The less loaded of two distinct random alive replicas."""
        live = live_replicas(replicas)
        if len(live) == 1:
            return live[0].replica_id
        first, second = self.rng.sample(live, 2)
        return min((first, second), key=lambda r: (r.load, r.kv_cache_usage)).replica_id


@hookimpl
def register_routers(register: Register) -> None:
    """Register ``power_of_two``."""
    register("power_of_two", PowerOfTwoRouter)
