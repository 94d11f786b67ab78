"""Greedy speculative decoding is token-identical to transformers ``generate`` (float32) and to
non-speculative decoding, for every drafter and k in {1, 2, 4}, under chunked prefill, preemption
and prefix caching, mixed with requests that do not speculate."""

from __future__ import annotations

import pytest
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE, hf_greedy

from framework import SamplingParams

PROMPTS = [
    "Once upon a time",
    "Lily and Tom went to the park. Lily and Tom went to the park. Lily and",
    "The dog ran to the park and",
    "One day, a little boy named Tim went to the store with his mom. He saw a big red ball",
    "There was a cat. The cat was big. The cat",
    "Tom and Sue were friends. They liked to play in the garden. One day they found a small bird that could not fly. "
    "Sue said, \"We have to help the bird!\" Tom nodded and",
    "Max had a toy car",
    "Once upon a time, in a small town, there lived a kind old man who had a garden full of flowers. Every morning he",
]
MAX_TOKENS = 40
DRAFTERS = ["ngram", "draft_model", "eagle"]
EXTRA = {"ngram": {}, "draft_model": {"model": STORIES_DRAFT}, "eagle": {"model": STORIES_EAGLE}}


def _params(drafter, k):
    return {"num_speculative_tokens": k, **EXTRA[drafter]}


def _check(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    expected = hf_greedy(STORIES, ids, max_tokens)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
    summary = llm.engine.metrics.summary()
    draft_kv = getattr(llm.engine.drafter, "kv", None)
    if draft_kv is not None:  # the draft model's own block pool is empty again (no leak)
        assert draft_kv.num_free_blocks == draft_kv.num_blocks, "draft KV blocks leaked"
    assert summary["spec_num_draft_tokens"] > 0, "the drafter never proposed: the test checks nothing"
    assert summary["spec_num_accepted_tokens"] > 0
    return summary


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_whole_batch(make_llm, drafter, k):
    summary = _check(make_llm(drafter=drafter, drafter_params=_params(drafter, k)))
    assert summary["spec_num_accepted_tokens"] < summary["spec_num_draft_tokens"], "expected some rejections"
    assert 1.0 < summary["spec_mean_accepted_length"] <= k + 1
    assert 1.0 < summary["tokens_per_forward"] <= k + 1


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("k", [1, 4])
def test_chunked_prefill_budget_trims_drafts(make_llm, drafter, k):
    llm = make_llm(drafter=drafter, drafter_params=_params(drafter, k), max_num_batched_tokens=12,
                   long_prefill_token_threshold=8)
    _check(llm)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_preemption(make_llm, drafter):
    llm = make_llm(drafter=drafter, drafter_params=_params(drafter, 4), num_blocks=36, block_size=16,
                   enable_prefix_caching=False)
    _check(llm, PROMPTS + PROMPTS, max_tokens=64)
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_prefix_caching_chunks_preemption(make_llm, drafter):
    llm = make_llm(drafter=drafter, drafter_params=_params(drafter, 2), block_size=4, num_blocks=140,
                   max_num_batched_tokens=40)
    _check(llm, PROMPTS + PROMPTS, max_tokens=40)
    assert llm.engine.kv_allocator.stats().hit_rate > 0
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_mixed_with_non_speculating_requests(make_llm, drafter):
    """Greedy requests speculate while sampled ones in the same batch (seeded) match a non-spec run."""
    prompts = PROMPTS[:4]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    sampled = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, seed=7)
    params = [greedy, sampled, greedy, sampled]
    spec = make_llm(drafter=drafter, drafter_params=_params(drafter, 3))
    outs = spec.generate(prompts, params)
    tok = spec.get_tokenizer()
    expected = hf_greedy(STORIES, [tok(p).input_ids for p in prompts], MAX_TOKENS)
    assert outs[0].outputs[0].token_ids == expected[0]
    assert outs[2].outputs[0].token_ids == expected[2]
    assert spec.engine.metrics.summary()["spec_num_draft_tokens"] > 0
