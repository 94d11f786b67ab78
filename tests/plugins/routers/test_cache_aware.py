"""cache_aware (SGLang's policy) and its approximate radix tree, on synthetic replica states."""

from __future__ import annotations

import pytest

from framework.interfaces.router import ReplicaState
from plugins.routers._approx_tree import ApproxRadixTree
from plugins.routers.cache_aware import CacheAwareRouter

PREFIX_A = list(range(100, 140))  # 40 shared tokens
PREFIX_B = list(range(300, 340))


def states(*loads: int, dead: tuple[int, ...] = ()) -> list[ReplicaState]:
    """Replica states with ``load`` running requests each."""
    return [ReplicaState(replica_id=i, num_running_reqs=n, alive=i not in dead) for i, n in enumerate(loads)]


def test_tree_matches_the_longest_routed_prefix_and_splits_edges():
    tree = ApproxRadixTree()
    tree.insert([1, 2, 3, 4], tenant=0)
    tree.insert([1, 2, 9], tenant=1)  # splits the [1, 2, 3, 4] edge after [1, 2]
    assert tree.match([1, 2, 3, 4, 5], allowed={0, 1}) == (4, 0)
    assert tree.match([1, 2, 9, 9], allowed={0, 1}) == (3, 1)
    assert tree.match([1, 2, 7], allowed={0, 1})[0] == 2  # the shared [1, 2]: the most recent tenant, 1
    assert tree.match([1, 2, 7], allowed={0, 1})[1] == 1
    assert tree.match([1, 2, 3], allowed={1}) == (2, 1)  # tenant 0's [3, 4] is not allowed
    assert tree.match([5], allowed={0, 1}) == (0, None)
    assert (tree.size(0), tree.size(1)) == (4, 3)


def test_tree_forgets_a_removed_tenant_and_evicts_lru_leaves():
    tree = ApproxRadixTree()
    tree.insert([1, 2, 3], 0)
    tree.insert([1, 2, 3], 1)
    tree.remove_tenant(0)
    assert tree.size(0) == 0 and tree.match([1, 2, 3], allowed={0}) == (0, None)
    assert tree.match([1, 2, 3], allowed={1}) == (3, 1)
    tree = ApproxRadixTree()
    tree.insert([1, 2, 3, 4], 0)  # older
    tree.insert([1, 2, 7, 8], 0)  # newer; the tree is [1, 2] -> {[3, 4], [7, 8]}: 6 tokens
    tree.evict(0, max_tokens=4)
    assert tree.size(0) == 4 and tree.match([1, 2, 3, 4], {0}) == (2, 0) and tree.match([1, 2, 7, 8], {0}) == (4, 0)
    tree.evict(0, max_tokens=1)  # [7, 8] goes, then [1, 2] (now a leaf)
    assert tree.size(0) == 0 and tree.match([1, 2], {0}) == (0, None)


def test_balanced_load_keeps_a_prefix_on_its_replica():
    router = CacheAwareRouter()
    first_a = router.route("a0", PREFIX_A + [1], states(0, 0, 0))
    first_b = router.route("b0", PREFIX_B + [2], states(0, 0, 0))
    assert first_a != first_b  # a new prefix goes to the replica with the smallest tree
    for i in range(10):
        assert router.route(f"a{i + 1}", PREFIX_A + [i], states(3, 5, 4)) == first_a
        assert router.route(f"b{i + 1}", PREFIX_B + [i], states(3, 5, 4)) == first_b


def test_below_the_cache_threshold_the_smallest_tree_wins():
    router = CacheAwareRouter(cache_threshold=0.5)
    assert router.route("a", PREFIX_A, states(0, 0)) == 0
    # matches 10 of 40 tokens (0.25 <= 0.5): replica 1 (empty tree) wins
    assert router.route("b", PREFIX_A[:10] + list(range(900, 930)), states(0, 0)) == 1


@pytest.mark.parametrize(("loads", "imbalanced"), [
    ((200, 100), True),   # difference 100 > 64 and 200 > 1.5 * 100
    ((200, 140), False),  # difference 60 <= 64
    ((230, 164), False),  # difference 66 > 64 but 230 <= 1.5 * 164 = 246
    ((164, 100), False),  # difference 64 is not > 64
    ((165, 100), True),   # difference 65 and 165 > 150
])
def test_imbalance_thresholds(loads, imbalanced):
    router = CacheAwareRouter()
    replicas = states(*loads)
    assert router.is_imbalanced(replicas) is imbalanced
    router.tree.insert(PREFIX_A, 0)  # replica 0 (the more loaded one) holds the prefix
    assert router.route("r", PREFIX_A + [7], replicas) == (1 if imbalanced else 0)


def test_a_dead_replica_is_never_chosen_and_is_forgotten():
    router = CacheAwareRouter()
    holder = router.route("a", PREFIX_A, states(0, 0, 0))
    dead = tuple([holder])
    choice = router.route("b", PREFIX_A + [5], states(0, 0, 0, dead=dead))
    assert choice != holder
    router.on_replica_removed(holder)
    assert router.tree.size(holder) == 0
    assert router.route("c", PREFIX_A + [6], states(0, 0, 0, dead=dead)) == choice  # the prefix moved with it


def test_tree_size_is_capped_per_replica():
    router = CacheAwareRouter(max_tree_size=50)
    for i in range(20):
        router.route(f"r{i}", list(range(1000 * i, 1000 * i + 30)), states(0))
    assert router.tree.size(0) <= 50


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareRouter(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwareRouter(balance_rel_threshold=0.5)
