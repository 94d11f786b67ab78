"""EPLB (``framework/model_executor/eplb.py``) on its own, no model: every logical expert keeps a replica,
every rank the same number of slots, the maps agree with each other, and on a skewed load the busiest
rank carries less than under the identity placement."""

from __future__ import annotations

import pytest
import torch

from framework.model_executor.eplb import (
    ExpertMaps,
    balanced_packing,
    default_maps,
    max_rank_load,
    rebalance_experts,
    replicate_experts,
)


def _skewed(num_layers: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    """Zipf-like loads: a few hot experts, shuffled per layer."""
    gen = torch.Generator().manual_seed(seed)
    base = 1000.0 / torch.arange(1, num_experts + 1).float() ** 1.2
    return torch.stack([base[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)]).round()


def _check_maps(maps: ExpertMaps, num_logical: int, num_physical: int) -> None:
    phy2log, log2phy, count = maps.physical_to_logical_map, maps.logical_to_physical_map, maps.logical_replica_count
    assert phy2log.shape[1] == num_physical and count.shape[1] == num_logical
    assert (count >= 1).all() and (count.sum(-1) == num_physical).all()
    for layer in range(phy2log.shape[0]):
        assert torch.bincount(phy2log[layer], minlength=num_logical).tolist() == count[layer].tolist()
        for e in range(num_logical):
            slots = log2phy[layer, e]
            real = slots[slots >= 0]
            assert len(real) == count[layer, e] and (slots[len(real):] == -1).all()
            assert (phy2log[layer, real] == e).all()


@pytest.mark.parametrize(("num_logical", "num_redundant", "num_ranks", "num_groups", "num_nodes"),
                         [(8, 0, 2, 1, 1), (8, 4, 4, 1, 1), (16, 8, 8, 4, 2), (6, 2, 4, 1, 1), (64, 32, 16, 8, 4)])
def test_maps_consistent_and_even(num_logical: int, num_redundant: int, num_ranks: int, num_groups: int,
                                  num_nodes: int) -> None:
    """Each expert has >= 1 replica, replicas total the slots, the two maps invert each other, and each
    rank owns ``P / ranks`` slots (by construction of the slot ranges: checked via the shapes)."""
    load = _skewed(3, num_logical)
    maps = rebalance_experts(load, num_logical + num_redundant, num_ranks, num_groups, num_nodes)
    _check_maps(maps, num_logical, num_logical + num_redundant)
    assert maps.physical_to_logical_map.view(3, num_ranks, -1).shape[-1] == (num_logical + num_redundant) // num_ranks


@pytest.mark.parametrize(("num_logical", "num_redundant", "num_ranks"), [(8, 0, 2), (16, 4, 4), (64, 16, 8)])
def test_skewed_load_max_rank_load_improves(num_logical: int, num_redundant: int, num_ranks: int) -> None:
    """The busiest rank's load falls below the identity placement's (vLLM's default EP layout) in every layer."""
    load = _skewed(4, num_logical, seed=1)
    physical = num_logical + num_redundant
    before = max_rank_load(load, default_maps(4, num_logical, num_logical, num_ranks), num_ranks)
    after = max_rank_load(load, rebalance_experts(load, physical, num_ranks), num_ranks)
    assert (after < before).all(), (before, after)
    assert (after >= load.sum(-1) / num_ranks - 1e-3).all()  # never below the perfect split


def test_hot_expert_gets_the_redundant_slots() -> None:
    """One expert with most of the load is replicated into the extra slots (load per replica highest)."""
    load = torch.tensor([[100.0, 1, 1, 1]])
    phy2log, _, count = replicate_experts(load, 6)
    assert count.tolist() == [[3, 1, 1, 1]] and sorted(phy2log[0].tolist()) == [0, 0, 0, 1, 2, 3]


def test_balanced_packing_equal_counts() -> None:
    """Packs hold equally many items and the greedy split of 6, 5, 4, 3, 2, 1 into 2 packs is 11 / 10."""
    pack, rank = balanced_packing(torch.tensor([[6.0, 5, 4, 3, 2, 1]]), 2)
    assert torch.bincount(pack[0]).tolist() == [3, 3]
    loads = [sum(w for w, p in zip([6, 5, 4, 3, 2, 1], pack[0].tolist()) if p == k) for k in (0, 1)]
    assert sorted(loads) == [10, 11] and sorted(rank[0].tolist()) == [0, 0, 1, 1, 2, 2]


def test_identity_without_redundant_experts() -> None:
    """No load measured and no redundant slots: rank r holds experts [r E / n, (r + 1) E / n), as vLLM's EP."""
    maps = default_maps(2, 8, 8, 2)
    assert maps.physical_to_logical_map.tolist() == [list(range(8))] * 2
    _check_maps(maps, 8, 8)


def test_bad_sizes_name_the_fix() -> None:
    """Slots the ranks cannot split, or fewer slots than experts, are refused with the key to change."""
    with pytest.raises(ValueError, match="num_redundant_experts"):
        rebalance_experts(torch.ones(1, 6), 7, 2)
    with pytest.raises(ValueError, match="cannot hold 8 experts"):
        rebalance_experts(torch.ones(1, 8), 6, 2)
    with pytest.raises(ValueError, match="num_layers, num_logical_experts"):
        rebalance_experts(torch.ones(8), 8, 2)
