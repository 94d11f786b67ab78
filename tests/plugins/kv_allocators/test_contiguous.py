"""The contiguous baseline: one max_model_len slab per request, no sharing, waste counted as fragmentation."""

from __future__ import annotations

import pytest

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from plugins.kv_allocators.contiguous import ContiguousKVAllocator


def make_request(request_id: str, n: int) -> Request:
    return Request(request_id, list(range(3, 3 + n)), SamplingParams())


def test_each_request_reserves_a_whole_slab() -> None:
    kv = ContiguousKVAllocator(num_blocks=10, block_size=4, max_model_len=16)  # slab = 4 blocks, 2 slabs
    a, b, c = make_request("a", 3), make_request("b", 5), make_request("c", 1)
    assert kv.allocate_slots(a, 3) == [0]
    assert kv.allocate_slots(b, 5) == [4, 5]
    assert kv.num_free_blocks == 2  # only the unusable remainder
    assert not kv.can_allocate(c, 1) and kv.allocate_slots(c, 1) is None
    a.num_computed_tokens = 3
    assert kv.allocate_slots(a, 2) == [1]  # grows inside its slab
    stats = kv.stats()
    assert stats.num_reserved_slots == 32 and stats.num_used_slots == 5 + 5
    assert stats.fragmentation == pytest.approx(1 - 10 / 32)
    kv.check_invariants()
    kv.free(a)
    assert kv.allocate_slots(c, 1) == [0]
    kv.free(b)
    kv.free(c)
    kv.free(c)  # idempotent
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_invariants()


def test_never_shares_and_never_exceeds_the_slab() -> None:
    kv = ContiguousKVAllocator(num_blocks=8, block_size=2, max_model_len=8)
    a = make_request("a", 4)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert not kv.can_allocate(a, 9)
    with pytest.raises(ValueError, match="num_new_tokens"):
        kv.can_allocate(a, -1)


def test_sizing_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        ContiguousKVAllocator(num_blocks=8, block_size=2)
    with pytest.raises(ValueError, match="raise the KV budget"):
        ContiguousKVAllocator(num_blocks=3, block_size=2, max_model_len=8)
