"""Greedy parity with transformers (float32) for every registered allocator (paged once per eviction
policy) x every registered scheduler policy x preemption mode (recompute, swap), with chunked
prefill, KV pressure (preemption) and shared-prefix prompts in one batch."""

from __future__ import annotations

import pytest
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS, assert_greedy_parity

from framework import registry
from plugins.kv_allocators._eviction import EVICTION_POLICIES

POLICIES = sorted(registry.available("scheduler"))
ALLOCATORS = [("paged", {"eviction": e}) for e in EVICTION_POLICIES] + [
    (name, {}) for name in sorted(registry.available("kv_allocator")) if name != "paged"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: "-".join([a[0], *map(str, a[1].values())]))
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
