"""Greedy parity with transformers ``generate`` (float32, token for token) under every
scheduler / batching regime: whole batch, chunked prefill, preemption, prefix caching, priority."""

from __future__ import annotations

import pytest
from helpers import PREFIX_PROMPTS, STORY_PROMPTS, assert_greedy_parity

MAX_TOKENS = 24


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_whole_batch(make_llm, scheduler):
    llm = make_llm(scheduler=scheduler)
    assert_greedy_parity(llm, STORY_PROMPTS, priority=[i % 3 for i in range(len(STORY_PROMPTS))])


def test_gqa_decode_kernel(make_llm):
    """The ablation switch attention.params.decode_kernel=gqa gives the same greedy tokens."""
    llm = make_llm(attention="torch", attention_params={"decode_kernel": "gqa"})
    assert_greedy_parity(llm, STORY_PROMPTS)


def test_chunked_prefill(make_llm):
    llm = make_llm(max_num_batched_tokens=24, long_prefill_token_threshold=16)
    tok = llm.get_tokenizer()
    longest = max(len(tok(p).input_ids) for p in STORY_PROMPTS)
    assert longest > 24
    assert_greedy_parity(llm, STORY_PROMPTS)
    assert llm.engine.metrics.summary()["num_steps"] > MAX_TOKENS


def test_prefill_query_tiles(make_llm):
    """Prefill chunks cut into 4-token causal query tiles (``attention.params.prefill_tile``), with
    chunked prefill and prefix caching, so that tiles carry cached context: same greedy tokens."""
    llm = make_llm(attention_params={"prefill_tile": 4}, block_size=8, max_num_batched_tokens=24)
    assert_greedy_parity(llm, PREFIX_PROMPTS + STORY_PROMPTS)
    assert llm.engine.kv_allocator.stats().hit_rate > 0


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_preemption(make_llm, scheduler):
    llm = make_llm(scheduler=scheduler, num_blocks=36, block_size=16, enable_prefix_caching=False)
    assert_greedy_parity(llm, STORY_PROMPTS + STORY_PROMPTS[:4], max_tokens=64,
           priority=[(7 * i) % 4 for i in range(len(STORY_PROMPTS) + 4)])
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


def test_prefix_caching(make_llm):
    llm = make_llm(block_size=8, max_num_seqs=4)
    assert_greedy_parity(llm, PREFIX_PROMPTS + STORY_PROMPTS[:8])
    assert llm.engine.kv_allocator.stats().hit_rate > 0.2


def test_prefix_caching_with_chunks_and_preemption(make_llm):
    llm = make_llm(block_size=4, num_blocks=140, max_num_batched_tokens=40)
    assert_greedy_parity(llm, PREFIX_PROMPTS + STORY_PROMPTS, max_tokens=40)
    stats = llm.engine.metrics.summary()
    assert llm.engine.kv_allocator.stats().hit_rate > 0
    assert stats["num_preemptions"] > 0


@pytest.mark.gpu
def test_whole_batch_on_cuda(make_llm):
    """The torch backend on CUDA: same greedy tokens as transformers (float32, TF32 off by default)."""
    llm = make_llm(device="cuda", max_num_batched_tokens=32)
    assert_greedy_parity(llm, STORY_PROMPTS)
