"""Greedy parity with transformers (float32) for every registered allocator (paged once per eviction
policy) x every registered scheduler policy, each pair under one preemption mode (recompute or swap,
alternating so that every allocator and every policy runs both modes: all pairs of the three factors are
covered), with chunked prefill, KV pressure (preemption) and shared-prefix prompts in one batch. The full
allocator x policy x mode product runs model-free in ``tests/framework/core/test_shadow_cache.py``."""

from __future__ import annotations

import pytest
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS, assert_greedy_parity

from framework import registry
from plugins.kv_allocators._eviction import EVICTION_POLICIES

POLICIES = sorted(registry.available("scheduler"))
ALLOCATORS = [("paged", {"eviction": e}) for e in EVICTION_POLICIES] + [
    (name, {}) for name in sorted(registry.available("kv_allocator")) if name != "paged"]
MODES = ("recompute", "swap")
#: (allocator, policy, mode): every allocator x policy pair once, the mode alternating along both (a pairwise
#: design: each allocator and each policy runs under both modes; the full product ran every pair twice)
CASES = [pytest.param(allocator, policy, MODES[(i + j) % 2],
                      id="-".join([allocator[0], *map(str, allocator[1].values()), policy, MODES[(i + j) % 2]]))
         for i, allocator in enumerate(ALLOCATORS) for j, policy in enumerate(POLICIES)]


def test_cases_cover_every_pair() -> None:
    """The pairwise design's promise: every allocator x policy, allocator x mode and policy x mode pair runs."""
    runs = [tuple(case.values) for case in CASES]
    assert {(a[0], str(a[1]), p) for a, p, _ in runs} == {(a[0], str(a[1]), p) for a in ALLOCATORS for p in POLICIES}
    assert {(a[0], str(a[1]), m) for a, _, m in runs} == {(a[0], str(a[1]), m) for a in ALLOCATORS for m in MODES}
    assert {(p, m) for _, p, m in runs} == {(p, m) for p in POLICIES for m in MODES}


@pytest.mark.parametrize(("allocator", "policy", "mode"), CASES)
def test_allocator_x_policy_greedy_parity(make_llm, allocator, policy, mode):
    name, params = allocator
    swap = {"preemption_mode": "swap", "swap_space_bytes": 12 * 16 * 2 * 4 * 8 * 4 * 5} if mode == "swap" else {}
    # prompts are 2-85 tokens; contiguous reserves max_model_len=128 tokens (8 blocks) per request -> 4 slabs
    llm = make_llm(model=STORIES, kv_allocator=name, kv_allocator_params=params, scheduler=policy, block_size=16,
                   num_blocks=32 if name == "contiguous" else 24, max_model_len=128, max_num_batched_tokens=48,
                   long_prefill_token_threshold=24, **swap)
    prompts = PREFIX_PROMPTS[:5] + STORY_PROMPTS[:11]
    assert_greedy_parity(llm, prompts, priority=[(5 * i) % 3 for i in range(len(prompts))], max_tokens=32)
    summary = llm.engine.metrics.summary()
    if name != "contiguous":  # contiguous reserves up front: it queues instead of preempting
        assert summary["num_preemptions"] > 0, "KV pressure did not force a preemption"
        if mode == "swap":  # 12 blocks of swap space: some victims swap, the rest fall back to recompute
            assert summary["num_preemptions_swap"] > 0 and summary["num_swap_in_blocks"] > 0
            assert summary["swapped_bytes"] > 0
