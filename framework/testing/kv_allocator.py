"""KV-allocator invariants (``framework.interfaces.KVAllocator``) under a seeded random schedule of
admissions, decode growth and frees, driven the way ``framework.core.scheduler`` drives an allocator.

Shadow-cache seam: when ``framework/testing/shadow_cache.py`` exists (an exact reference simulation
of the prefix cache, written separately) and defines ``check_against_shadow_cache(allocator_cls,
**kwargs)``, :func:`check_kv_allocator` also runs it; until then only the invariants below run.
"""

from __future__ import annotations

import random

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.interfaces import KVAllocator
from framework.testing.shadow_cache import check_against_shadow_cache


def _owned(kv: KVAllocator, live: list[Request]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for req in live:
        for block in kv.get_block_ids(req.request_id):
            counts[block] = counts.get(block, 0) + 1
    return counts


def _admit(kv: KVAllocator, req: Request, block_size: int) -> bool:
    """Admission as the scheduler does it: prefix lookup, then allocate the rest of the prompt."""
    blocks, num_hit = kv.get_computed_blocks(req)
    assert num_hit % block_size == 0 and num_hit < req.num_tokens, \
        f"get_computed_blocks returned {num_hit} hit tokens for {req.num_tokens} (block-aligned, < all tokens)"
    assert len(blocks) * block_size == num_hit, "one cached block per block_size hit tokens"
    num_new = req.num_tokens - num_hit
    free_before = kv.num_free_blocks
    can = kv.can_allocate(req, num_new, blocks)
    assert kv.num_free_blocks == free_before, "can_allocate must not change state"
    new = kv.allocate_slots(req, num_new, blocks)
    assert (new is not None) == can, "can_allocate must predict allocate_slots"
    if new is None:
        assert kv.num_free_blocks == free_before and not kv.get_block_ids(req.request_id), \
            "a failed allocate_slots must change nothing"
        return False
    req.num_computed_tokens = req.num_tokens
    return True


def check_kv_allocator(allocator_cls: type[KVAllocator], num_blocks: int = 24, block_size: int = 4,
                       steps: int = 300, seed: int = 0) -> None:
    """Random admissions / one-token decodes / frees with and without prefix caching; after every
    operation: block ids lie in ``[0, num_blocks)``, a block table covers the request's tokens,
    without prefix caching no block has two owners, ``num_free_blocks`` equals ``num_blocks`` minus
    the distinct owned blocks (prefix caching off) and never exceeds ``num_blocks``; at the end,
    freeing everything returns every block. Then the shadow-cache check, when available.

    Raises:
        AssertionError: naming the broken invariant.
    """
    assert issubclass(allocator_cls, KVAllocator), f"{allocator_cls!r} must subclass KVAllocator"
    for prefix_caching in (False, True):
        rng = random.Random(seed)
        kv = allocator_cls(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching)
        live: list[Request] = []
        shared_prefix = [rng.randrange(3, 100) for _ in range(2 * block_size)]
        for step in range(steps):
            op = rng.random()
            if op < 0.4 or not live:
                tail = [rng.randrange(3, 100) for _ in range(rng.randint(1, 3 * block_size))]
                prompt = (shared_prefix + tail) if rng.random() < 0.5 else tail
                req = Request(request_id=f"s{step}", prompt_token_ids=prompt, sampling_params=SamplingParams())
                if _admit(kv, req, block_size):
                    live.append(req)
            elif op < 0.8:
                req = rng.choice(live)
                req.append_output_token(rng.randrange(3, 100))
                if kv.allocate_slots(req, 1) is not None:
                    req.num_computed_tokens += 1
                else:  # pool exhausted: preempt (free) it, as the scheduler does
                    kv.free(req)
                    live.remove(req)
            else:
                req = live.pop(rng.randrange(len(live)))
                kv.free(req)
            owned = _owned(kv, live)
            assert all(0 <= b < num_blocks for b in owned), "block id out of range"
            for req in live:
                assert len(kv.get_block_ids(req.request_id)) * block_size >= req.num_computed_tokens, \
                    f"block table of {req.request_id} does not cover its computed tokens"
            assert 0 <= kv.num_free_blocks <= num_blocks - len(owned), "num_free_blocks counts an owned block"
            if not prefix_caching:
                assert all(c == 1 for c in owned.values()), "a block owned twice without prefix caching"
                assert kv.num_free_blocks == num_blocks - len(owned), "num_free_blocks != unowned blocks"
        for req in live:
            kv.free(req)
            kv.free(req)  # freeing twice is a no-op
        assert kv.num_free_blocks == num_blocks, f"{num_blocks - kv.num_free_blocks} blocks leaked"
        assert 0.0 <= kv.stats().usage <= 1.0, "stats().usage must be a fraction in [0, 1]"
    check_against_shadow_cache(allocator_cls)
