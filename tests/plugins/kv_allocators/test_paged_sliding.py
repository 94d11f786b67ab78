"""Sliding-window KV memory in ``plugins.kv_allocators.paged`` (vLLM's hybrid KV-cache manager): out-of-window
blocks released to the null block, the sliding-window prefix-cache hit rule, hits reconciled across full and
sliding groups, and allocations that fit only thanks to the blocks they release. The random workloads of
``tests/framework/core/test_shadow_cache.py`` check the same allocator against the shadow cache."""

from __future__ import annotations

import pytest

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.interfaces import KVCacheGroup
from plugins.kv_allocators.contiguous import ContiguousKVAllocator
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.kv_allocators.radix import RadixKVAllocator

FULL, SLIDING = KVCacheGroup((0,)), KVCacheGroup((1,), sliding_window=6)


def admit(kv: PagedKVAllocator, request: Request) -> list:
    """Prefix lookup, then allocate the rest of the prompt; returns the hit entries."""
    blocks, hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.check_invariants()
    return blocks


def decode(kv: PagedKVAllocator, request: Request, token: int = 7) -> None:
    request.append_output_token(token)
    assert kv.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1
    kv.check_invariants()


def test_out_of_window_blocks_are_released_and_stay_hittable():
    """Window 6, blocks of 4: from position 16 on no query sees blocks 0 and 1 (keys 11..16), so they are
    released (their entries become the null block) and join the free queue still cached: a request with
    the same prompt hits all four prompt blocks, needing only the two before the hit point."""
    kv = PagedKVAllocator(num_blocks=16, block_size=4, kv_cache_groups=(KVCacheGroup((0, 1), 6),))
    first = Request("a", list(range(100, 116)), SamplingParams())
    admit(kv, first)
    table = list(kv.get_block_ids("a"))
    assert kv.num_held_blocks("a") == (4,)
    decode(kv, first)
    assert kv.get_block_ids("a") == [kv.null_block, kv.null_block, *table[2:], kv.get_block_ids("a")[4]]
    assert kv.num_held_blocks("a") == (3,) and kv.num_free_blocks == 16 - 3
    hit, num_hit = kv.get_computed_blocks(Request("b", list(range(100, 116)) + [1], SamplingParams()))
    assert (hit, num_hit) == ([kv.null_block, kv.null_block, *table[2:]], 16)


def test_hybrid_hit_is_what_every_group_can_serve():
    """Full + sliding groups: the hit is the longest prefix the full group has cached whose window blocks
    the sliding group also has; when a sliding block was evicted, the fixed point shortens the hit."""
    kv = PagedKVAllocator(num_blocks=32, block_size=4, kv_cache_groups=(FULL, SLIDING))
    prompt = list(range(200, 220))  # 5 full blocks
    first = Request("a", prompt, SamplingParams())
    admit(kv, first)
    full, sliding = (list(t) for t in kv.get_block_tables("a"))
    kv.free(first)
    second = Request("b", prompt + [1, 2, 3, 4, 5], SamplingParams())
    hit, num_hit = kv.get_computed_blocks(second)
    null = kv.null_block
    assert num_hit == 20 and hit == list(zip(full, [null, null, null, *sliding[3:]]))
    kv._unpublish(sliding[3])  # evicted (as if popped for other content)
    hit, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 12 and hit == list(zip(full[:3], [null, *sliding[1:3]]))
    admit(kv, second)
    assert kv.num_held_blocks("b") == (7, 6)  # 25 tokens; the sliding table starts with one null entry
    decode(kv, second)  # first new token at 25: keys 20.. -> blocks 0..4 released
    assert kv.num_held_blocks("b") == (7, 2)
    kv.free(second)
    assert kv.num_free_blocks == 32
    kv.check_invariants()


def test_an_allocation_that_fits_only_thanks_to_its_releases():
    """A two-block pool: a decode past the window needs a third block and releases the first one."""
    kv = PagedKVAllocator(num_blocks=2, block_size=4, kv_cache_groups=(KVCacheGroup((0,), 4),))
    request = Request("a", list(range(8)), SamplingParams())
    admit(kv, request)
    assert kv.num_free_blocks == 0
    decode(kv, request)
    assert kv.num_held_blocks("a") == (2,) and kv.get_block_ids("a")[0] == kv.null_block


def test_window_of_one_token_hits_without_blocks():
    """W = 1: a query sees only itself, so a hit needs no cached block at all (every entry null)."""
    kv = PagedKVAllocator(num_blocks=8, block_size=4, kv_cache_groups=(KVCacheGroup((0,), 1),))
    hit, num_hit = kv.get_computed_blocks(Request("a", list(range(9)), SamplingParams()))
    assert (hit, num_hit) == ([kv.null_block] * 2, 8)


@pytest.mark.parametrize("cls", [RadixKVAllocator, ContiguousKVAllocator])
def test_allocators_without_groups_refuse_them(cls):
    assert not cls.supports_kv_cache_groups
    with pytest.raises(ValueError, match="supports_kv_cache_groups is False"):
        cls(num_blocks=8, block_size=4, max_model_len=16, kv_cache_groups=(FULL, SLIDING))


def test_contiguous_reports_its_whole_slab_as_held():
    kv = ContiguousKVAllocator(num_blocks=8, block_size=4, max_model_len=16)
    kv.allocate_slots(Request("a", [1, 2, 3], SamplingParams()), 3)
    assert kv.num_held_blocks("a") == (4,) and kv.num_held_blocks("x") == (0,)
