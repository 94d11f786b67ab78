"""round_robin, random, power_of_two, least_loaded on synthetic replica states (ties, a replica gone)."""

from __future__ import annotations

from collections import Counter

import pytest

from framework.interfaces.router import NoReplicaError, ReplicaState
from plugins.routers.least_loaded import LeastLoadedRouter
from plugins.routers.power_of_two import PowerOfTwoRouter
from plugins.routers.random import RandomRouter
from plugins.routers.round_robin import RoundRobinRouter


def states(*loads: tuple[int, int], dead: tuple[int, ...] = (), usage: tuple[float, ...] = ()) -> list[ReplicaState]:
    """Replica states from (waiting, running) pairs."""
    return [ReplicaState(replica_id=i, num_waiting_reqs=w, num_running_reqs=r, alive=i not in dead,
                         kv_cache_usage=usage[i] if usage else 0.0) for i, (w, r) in enumerate(loads)]


def test_round_robin_cycles_and_skips_a_dead_replica():
    router = RoundRobinRouter()
    assert [router.route(f"r{i}", [1], states((0, 0), (0, 0), (0, 0))) for i in range(4)] == [0, 1, 2, 0]
    assert [router.route(f"d{i}", [1], states((0, 0), (0, 0), (0, 0), dead=(1,))) for i in range(3)] == [2, 0, 2]


def test_every_router_fails_when_no_replica_is_alive():
    for router in (RoundRobinRouter(), RandomRouter(), PowerOfTwoRouter(), LeastLoadedRouter()):
        with pytest.raises(NoReplicaError, match="dead"):
            router.route("r", [1], states((0, 0), (0, 0), dead=(0, 1)))


def test_random_is_roughly_uniform_over_alive_replicas_and_seeded():
    router = RandomRouter(seed=3)
    picks = Counter(router.route(f"r{i}", [1], states((0, 0), (9, 9), (0, 0), (0, 0), dead=(2,))) for i in range(1200))
    assert set(picks) == {0, 1, 3} and all(300 < n < 500 for n in picks.values())
    first, second = RandomRouter(seed=5), RandomRouter(seed=5)
    replicas = states((0, 0), (0, 0), (0, 0))
    assert [first.route(f"r{i}", [1], replicas) for i in range(20)] == \
        [second.route(f"r{i}", [1], replicas) for i in range(20)]


def test_power_of_two_sends_to_the_less_loaded_of_the_pair():
    router = PowerOfTwoRouter(seed=0)
    # two replicas: the pair is always both, so the less loaded always wins
    assert {router.route(f"r{i}", [1], states((0, 10), (0, 2))) for i in range(50)} == {1}
    # tie on load: the lower KV usage wins
    assert {router.route(f"t{i}", [1], states((1, 1), (1, 1), usage=(0.9, 0.1))) for i in range(50)} == {1}
    # the most loaded of three is never chosen (it loses every pair it is in)
    picks = Counter(router.route(f"m{i}", [1], states((0, 1), (0, 2), (0, 30))) for i in range(300))
    assert picks[2] == 0 and picks[0] > picks[1] > 0


def test_power_of_two_with_one_alive_replica():
    assert PowerOfTwoRouter().route("r", [1], states((0, 50), (0, 0), dead=(1,))) == 0


def test_least_loaded_weighs_waiting_four_times_running():
    router = LeastLoadedRouter()
    # replica 0: 1 waiting (score 4); replica 1: 3 running (score 3) -> 1
    assert router.route("a", [1], states((1, 0), (0, 3))) == 1
    # with waiting_weight=1 the scores are 1 and 3 -> 0
    assert LeastLoadedRouter(waiting_weight=1).route("b", [1], states((1, 0), (0, 3))) == 0


def test_least_loaded_ties_rotate_and_skip_the_dead():
    router = LeastLoadedRouter()
    assert [router.route(f"r{i}", [1], states((0, 0), (0, 0), (0, 0))) for i in range(4)] == [0, 1, 2, 0]
    assert [router.route(f"d{i}", [1], states((0, 0), (0, 0), (0, 0), dead=(1,))) for i in range(3)] == [2, 0, 2]
    with pytest.raises(ValueError, match="waiting_weight"):
        LeastLoadedRouter(waiting_weight=-1)
