"""prefix_score (llm-d's filter -> score -> pick) on synthetic replica states."""

from __future__ import annotations

import pytest

from framework.interfaces.router import ReplicaState
from plugins.routers.prefix_score import PrefixScoreRouter, block_hashes

PROMPT = list(range(100, 164))  # 4 blocks of 16


def states(*waiting: int, usage: tuple[float, ...] = (), dead: tuple[int, ...] = ()) -> list[ReplicaState]:
    return [ReplicaState(replica_id=i, num_waiting_reqs=w, kv_cache_usage=usage[i] if usage else 0.0,
                         alive=i not in dead) for i, w in enumerate(waiting)]


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    hashes = block_hashes(PROMPT + [1, 2, 3], block_size=16, max_blocks=256)
    assert len(hashes) == 4 and len(set(hashes)) == 4
    assert block_hashes(PROMPT, 16, 2) == hashes[:2]
    other = block_hashes([999] + PROMPT[1:], 16, 256)  # first block differs: every later hash differs too
    assert not set(other) & set(hashes)


def test_the_replica_that_got_a_prefix_gets_it_again():
    router = PrefixScoreRouter(seed=1)
    first = router.route("a", PROMPT + [1], states(0, 0, 0))
    for i in range(5):
        assert router.route(f"r{i}", PROMPT + [i + 2], states(0, 0, 0)) == first


def test_scores_weigh_prefix_queue_and_kv():
    router = PrefixScoreRouter()
    router.route("seed", PROMPT, states(0, 0))  # ties: a random one gets the prefix
    holder = next(i for i in (0, 1) if router.prefix_score(block_hashes(PROMPT, 16, 256), i) == 1.0)
    waiting = [0, 0]
    waiting[holder] = 10  # the holder has the longest queue: queue score 0 there, 1 on the other
    scores = router.scores(PROMPT, states(*waiting))
    assert scores[holder] == pytest.approx(3.0 + 0.0 + 2.0)
    assert scores[1 - holder] == pytest.approx(0.0 + 2.0 + 2.0)
    assert router.route("x", PROMPT, states(*waiting)) == holder  # 5 > 4: the prefix still wins
    heavy_queue = PrefixScoreRouter(queue_weight=4.0)
    heavy_queue._index = router._index
    assert heavy_queue.route("y", PROMPT, states(*waiting)) == 1 - holder  # 3 < 6: the queue wins
    usage = [0.0, 0.0]
    usage[1 - holder] = 1.0
    assert PrefixScoreRouter(prefix_weight=0.0).route("z", [1, 2], states(0, 0, usage=tuple(usage))) == holder


def test_a_dead_replica_is_filtered_and_its_index_dropped():
    router = PrefixScoreRouter()
    holder = router.route("a", PROMPT, states(0, 0, 0))
    dead = (holder,)
    assert router.route("b", PROMPT, states(0, 0, 0, dead=dead)) != holder
    router.on_replica_removed(holder)
    assert router.prefix_score(block_hashes(PROMPT, 16, 256), holder) == 0.0


def test_the_index_is_an_lru_of_bounded_size():
    router = PrefixScoreRouter(lru_capacity_per_replica=4)
    router.route("a", PROMPT, states(0))
    router.route("b", list(range(500, 532)), states(0))  # 2 new blocks push out the 2 oldest
    assert router.prefix_score(block_hashes(PROMPT, 16, 256), 0) == 0.0
    assert len(router._index[0]) == 4


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="block_size"):
        PrefixScoreRouter(block_size=0)
    with pytest.raises(ValueError, match="queue_weight"):
        PrefixScoreRouter(queue_weight=-1)
