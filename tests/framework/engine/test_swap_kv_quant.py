"""Swap preemption carries quantized KV (int8/fp8 values and their scales live in one block tensor):
swapped runs produce exactly the tokens of recompute runs with the same KV dtype."""

from __future__ import annotations

import pytest
from helpers import STORY_PROMPTS

from framework import SamplingParams


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_swap_equals_recompute_with_quantized_kv(make_llm, kv_cache_dtype):
    outs = {}
    for mode in ("recompute", "swap"):
        swap = {"preemption_mode": "swap", "swap_space_bytes": 1 << 20} if mode == "swap" else {}
        llm = make_llm(kv_cache_dtype=kv_cache_dtype, num_blocks=24, block_size=16, max_model_len=128,
                       enable_prefix_caching=False, **swap)
        res = llm.generate(STORY_PROMPTS[:12], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
        outs[mode] = [o.outputs[0].token_ids for o in res]
        summary = llm.engine.metrics.summary()
        assert summary["num_preemptions"] > 0
        if mode == "swap":
            assert summary["num_preemptions_swap"] > 0 and summary["swapped_bytes"] > 0
    assert outs["swap"] == outs["recompute"]
