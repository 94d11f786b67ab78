"""Router contract (``framework.interfaces.Router``), model-free: on random synthetic replica states a router
returns an alive replica's id, leaves its arguments alone, never picks a dead replica (before or after
``on_replica_removed``), and is reproducible from its seed."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

from framework.interfaces.router import ReplicaState, Router


def synthetic_replicas(rng: random.Random, num_replicas: int, num_dead: int = 0) -> list[ReplicaState]:
    """``num_replicas`` replica states with random loads and KV usage; ``num_dead`` random ones dead."""
    dead = set(rng.sample(range(num_replicas), num_dead))
    return [ReplicaState(replica_id=i, num_waiting_reqs=rng.randint(0, 20), num_running_reqs=rng.randint(0, 40),
                         kv_cache_usage=rng.random(), alive=i not in dead, published_s=0.0)
            for i in range(num_replicas)]


def synthetic_prompts(rng: random.Random, n: int) -> list[list[int]]:
    """``n`` prompts drawn from 4 shared prefixes of 0-48 tokens plus random tails (so prefixes repeat)."""
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(0, 48))] for _ in range(4)]
    return [rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 24))] for _ in range(n)]


def _choices(router: Router, seed: int, num_requests: int) -> list[int]:
    rng = random.Random(seed)
    choices = []
    for i, prompt in enumerate(synthetic_prompts(rng, num_requests)):
        replicas = synthetic_replicas(rng, rng.randint(1, 6), 0)
        if len(replicas) > 1 and rng.random() < 0.3:  # a replica gone
            gone = rng.randrange(len(replicas))
            replicas[gone] = dataclasses.replace(replicas[gone], alive=False)
        before_prompt, before_replicas = list(prompt), copy.deepcopy(replicas)
        choice = router.route(f"r{i}", prompt, replicas)
        name = type(router).name
        assert isinstance(choice, int), f"{name}.route must return an int replica_id, got {type(choice).__name__}"
        assert prompt == before_prompt and replicas == before_replicas, f"{name}.route must not mutate its arguments"
        alive = {r.replica_id for r in replicas if r.alive}
        assert choice in alive, f"{name}.route chose replica {choice}, not an alive one of {sorted(alive)}"
        router.on_request_finished(f"r{i}", choice)
        choices.append(choice)
    return choices


def check_router(router_cls: type[Router], seed: int = 0, num_requests: int = 200, **params: Any) -> None:
    """The router contract on ``num_requests`` synthetic requests (prompts sharing prefixes, 1-6 replicas, a
    dead one in ~30% of the calls):

    * ``route`` returns the ``int`` id of an alive replica and mutates neither the prompt nor the states;
    * with a single alive replica, it returns that one;
    * two instances built with the same seed and params make the same choices (reproducible runs);
    * after ``on_replica_removed(i)``, replica ``i`` (now dead) is never chosen, even for prompts it was
      routed before.

    ``params`` are the router's own parameters (``router.params``).

    Raises:
        AssertionError: naming the broken contract.
    """
    assert issubclass(router_cls, Router), f"{router_cls!r} must subclass Router"
    name = router_cls.name
    assert name, f"{router_cls.__name__}.name (the registry key) must be set"
    first = _choices(router_cls(seed=seed, **params), seed, num_requests)
    again = _choices(router_cls(seed=seed, **params), seed, num_requests)
    assert first == again, f"{name}: two routers with the same seed made different choices (use self.rng)"
    rng = random.Random(seed + 1)
    router = router_cls(seed=seed, **params)
    only = [ReplicaState(replica_id=i, alive=i == 2) for i in range(4)]
    assert router.route("single", [5, 6, 7], only) == 2, f"{name} must choose the only alive replica"
    prompts = synthetic_prompts(rng, 40)
    healthy = [ReplicaState(replica_id=i) for i in range(3)]
    for i, prompt in enumerate(prompts):
        router.route(f"warm{i}", prompt, healthy)
    router.on_replica_removed(1)
    without = [ReplicaState(replica_id=i, alive=i != 1) for i in range(3)]
    for i, prompt in enumerate(prompts):
        choice = router.route(f"after{i}", prompt, without)
        assert choice != 1, f"{name} chose replica 1 after on_replica_removed(1) (it is dead)"
