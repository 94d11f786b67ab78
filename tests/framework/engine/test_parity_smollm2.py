"""Greedy parity with transformers on the default real model, SmolLM2-135M-Instruct (float32)."""

from __future__ import annotations

import pytest
from helpers import hf_greedy

from framework import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Hi",
    "Translate 'good morning' into Spanish.",
    "The quick brown fox",
    "Give me a short tip for learning to program. Keep it practical and concrete, and mention one tool that helps "
    "beginners get feedback quickly on their code.",
    "Why is the sky blue? Answer like a physics teacher talking to a curious ten-year-old child who loves space.",
    "Name a famous painting.",
    "What does a CPU do?",
    "Summarize the plot of Romeo and Juliet in two sentences, without spoilers about the ending if possible.",
    "1, 2, 3, 4,",
    "Describe a cat.",
    "How do I boil an egg? Please give the steps in order, with times for soft and hard boiled eggs, and a tip for "
    "peeling them easily afterwards.",
    "Tell me a joke about computers.",
]
SYSTEM = "You are a concise assistant. Answer in plain English and keep every answer short. "
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from framework.model_executor.model_loader import resolve_model_path

    return resolve_model_path("smollm2")


def _check(llm, path, prompts, **gen_kwargs):
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        **gen_kwargs)
    expected = hf_greedy(path, ids, MAX_TOKENS)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({prompts[i]!r}) diverged from transformers"


def test_chunked_prefill_and_prefix_caching(make_llm, smollm2_path):
    """Also ``torch_paged``'s SmolLM2 parity (GQA 9:3, head size 64; named, should the default change):
    decodes of 8 or more requests in place, prefill chunks through the reference, prefix hits."""
    llm = make_llm(model=smollm2_path, dtype="float32", attention="torch_paged", max_model_len=512,
                   max_num_batched_tokens=24, long_prefill_token_threshold=16, block_size=8)
    _check(llm, smollm2_path, PROMPTS + [SYSTEM + p for p in PROMPTS[:6]])
    assert llm.engine.kv_allocator.stats().hit_rate > 0


def test_whole_batch_with_preemption(make_llm, smollm2_path):
    """The whole batch prefilled at once (default step budget) under the priority scheduler, with KV pressure:
    requests preempted and recomputed still equal transformers. The first-come scheduler's parity is
    ``test_chunked_prefill_and_prefix_caching``'s (and the research set's, below)."""
    # block_size 8 as above: the compiled kernel's block size is static, so one graph serves both tests
    llm = make_llm(model=smollm2_path, dtype="float32", scheduler="priority", max_model_len=128, num_blocks=24,
                   block_size=8)
    _check(llm, smollm2_path, PROMPTS, priority=[(5 * i) % 3 for i in range(len(PROMPTS))])
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


@pytest.mark.parametrize("kv_cache,scheduler,mode", [("radix", "lpm", "swap"), ("paged", "sjf", "recompute"),
                                                     ("contiguous", "fair", "recompute")])
def test_kv_research_set(make_llm, smollm2_path, kv_cache, scheduler, mode):
    """The scheduling/KV research set on the real model: chunked prefill, KV pressure and shared
    system-prompt prefixes in one batch, every token equal to transformers."""
    block_bytes = 2 * 4 * 3 * 64 * 4 * 30  # K+V, 4 tokens, 3 kv heads x 64, float32, 30 layers
    swap = {"preemption_mode": "swap", "swap_space_bytes": 8 * block_bytes} if mode == "swap" else {}
    llm = make_llm(model=smollm2_path, dtype="float32", kv_allocator=kv_cache, scheduler=scheduler, max_model_len=64,
                   num_blocks=32 if kv_cache == "contiguous" else 16, block_size=4, max_num_batched_tokens=48,
                   long_prefill_token_threshold=32, **swap)
    prompts = PROMPTS[:8] + [SYSTEM + p for p in PROMPTS[:4]]
    _check(llm, smollm2_path, prompts)
    summary = llm.engine.metrics.summary()
    if kv_cache != "contiguous":
        assert summary["num_preemptions"] > 0
    if mode == "swap":
        assert summary["num_preemptions_swap"] > 0
