"""Greedy parity with transformers ``generate`` (float32, token for token) under every
scheduler / batching regime: whole batch, chunked prefill, preemption, prefix caching, priority."""

from __future__ import annotations

import pytest
from helpers import STORIES, hf_greedy

from framework import SamplingParams

STORY_PROMPTS = [
    "Once upon a time",
    "Lily",
    "The dog ran to the park and",
    "One day, a little boy named Tim went to the store with his mom. He saw a big red ball",
    "There was a cat.",
    "Tom and Sue were friends. They liked to play in the garden. One day they found a small bird that could not fly. "
    "Sue said, \"We have to help the bird!\" Tom nodded and",
    "The sun was hot",
    "Once upon a time, in a small town, there lived a kind old man who had a garden full of flowers. Every morning he",
    "Max had a toy car",
    "Mom said, \"Time for bed.\" But Ben did not want to sleep. He wanted to",
    "A big fish swam in the sea. It was very hungry and looked for food. Then it saw a",
    "Anna liked to draw. She drew a sun, a tree and a house. Her dad came home and",
    "The bird",
    "It was a rainy day. Sam could not go outside. He was sad and bored. His sister had an idea: let's build a fort with "
    "blankets and chairs! They worked hard and",
    "Zoe found a shiny key under her bed.",
    "The little bear wanted honey. He climbed the tall tree, but the bees",
    "Once upon a time there was a girl who loved to sing",
]
SHARED_PREFIX = ("Once upon a time, in a small town, there lived a kind old man who had a garden full of flowers. "
                 "Every morning he watered them and talked to the birds. ")
PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in
                  ["One day", "He had a dog named Spot.", "A girl came by and asked", "The birds sang", "But then",
                   "His friend Sue", "It was spring and", "The flowers were"]]
MAX_TOKENS = 24


def _ids(llm, prompts):
    tok = llm.get_tokenizer()
    return [tok(p).input_ids for p in prompts]


def _check(llm, prompts, priority=None, max_tokens=MAX_TOKENS):
    ids = _ids(llm, prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, priority=priority)
    expected = hf_greedy(STORIES, ids, max_tokens)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
    return outs


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_whole_batch(make_llm, scheduler):
    llm = make_llm(scheduler=scheduler)
    _check(llm, STORY_PROMPTS, priority=[i % 3 for i in range(len(STORY_PROMPTS))])


def test_gqa_decode_kernel(make_llm):
    """The ablation switch attention.params.decode_kernel=gqa gives the same greedy tokens."""
    llm = make_llm(attention_params={"decode_kernel": "gqa"})
    _check(llm, STORY_PROMPTS)


def test_chunked_prefill(make_llm):
    llm = make_llm(max_num_batched_tokens=24, long_prefill_token_threshold=16)
    longest = max(len(i) for i in _ids(llm, STORY_PROMPTS))
    assert longest > 24
    _check(llm, STORY_PROMPTS)
    assert llm.engine.metrics.summary()["num_steps"] > MAX_TOKENS


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_preemption(make_llm, scheduler):
    llm = make_llm(scheduler=scheduler, num_blocks=36, block_size=16, enable_prefix_caching=False)
    _check(llm, STORY_PROMPTS + STORY_PROMPTS[:4], max_tokens=64,
           priority=[(7 * i) % 4 for i in range(len(STORY_PROMPTS) + 4)])
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


def test_prefix_caching(make_llm):
    llm = make_llm(block_size=8, max_num_seqs=4)
    _check(llm, PREFIX_PROMPTS + STORY_PROMPTS[:8])
    assert llm.engine.kv_allocator.stats().hit_rate > 0.2


def test_prefix_caching_with_chunks_and_preemption(make_llm):
    llm = make_llm(block_size=4, num_blocks=140, max_num_batched_tokens=40)
    _check(llm, PREFIX_PROMPTS + STORY_PROMPTS, max_tokens=40)
    stats = llm.engine.metrics.summary()
    assert llm.engine.kv_allocator.stats().hit_rate > 0
    assert stats["num_preemptions"] > 0


@pytest.mark.gpu
def test_whole_batch_on_cuda(make_llm):
    """The torch backend on CUDA: same greedy tokens as transformers (float32, TF32 off by default)."""
    llm = make_llm(device="cuda", max_num_batched_tokens=32)
    _check(llm, STORY_PROMPTS)
