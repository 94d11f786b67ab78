"""Parallel sampling (``SamplingParams.n``, ``framework/engine/parallel_sampling.py``): per-sample seeds as
vLLM derives them, the prompt's KV blocks shared through the prefix cache (metrics show it), output
kinds, aborts, and the ``AsyncLLM`` stream of one ``n > 1`` request."""

from __future__ import annotations

import asyncio

import pytest
from helpers import STORY_PROMPTS

from framework import SamplingParams
from framework.core.sampling_params import RequestOutputKind
from framework.engine.async_llm import AsyncLLM

PROMPT = STORY_PROMPTS[5]  # 74 tokens with stories260K's tokenizer: four full 16-token blocks


@pytest.fixture
def llm(make_llm):
    return make_llm(dtype="float32", compile=False, num_blocks=256)


def test_seeded_samples_are_distinct_and_equal_each_seed_alone(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234, n=4)
    out = llm.generate(PROMPT, params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 4, "the four sequences must not repeat one seed"
    for i, sample in enumerate(samples):
        alone = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234 + i))[0]
        assert tuple(alone.outputs[0].token_ids) == sample
        assert out.outputs[i].text == alone.outputs[0].text


def test_unseeded_samples_differ_and_greedy_ones_agree(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=3))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, n=3))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1


def test_prompt_blocks_are_computed_once_and_shared(make_llm):
    """Sequence 0 computes the prompt and publishes its full blocks at admission; the other n - 1 hit them
    in the same step (only the partial last block is per sequence). Without prefix caching nothing is shared."""
    for caching in (True, False):
        llm = make_llm(dtype="float32", compile=False, num_blocks=256, enable_prefix_caching=caching)
        num_prompt = len(llm.get_tokenizer()(PROMPT).input_ids)
        out = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=4, n=4, seed=0))[0]
        shared = 3 * ((num_prompt - 1) // 16 * 16) if caching else 0
        assert out.num_cached_tokens == shared
        summary = llm.engine.metrics.summary()
        assert summary["num_requests"] == 4  # the metrics count sequences, as vLLM's
        assert summary["prefix_cache_hit_rate"] == pytest.approx(shared / (4 * num_prompt))


def test_prompt_logprobs_come_from_sequence_zero(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=5, prompt_logprobs=1))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.num_cached_tokens == 2 * ((len(out.prompt_token_ids) - 1) // 16 * 16)  # sequences 1, 2 hit the cache


def test_bad_seed_is_refused_before_anything_is_queued(llm):
    params = SamplingParams(temperature=1.0, max_tokens=4, n=3, seed=2**64 - 2)  # seed + 2 is out of range
    with pytest.raises(ValueError, match="seed"):
        llm.engine.add_request("bad", PROMPT, params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.add_request("ok", PROMPT, SamplingParams(max_tokens=2, n=2))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("ok", PROMPT, SamplingParams(max_tokens=2))
    outs = llm.engine.abort_request("ok")
    assert len(outs) == 1 and outs[0].finished and [c.finish_reason for c in outs[0].outputs] == ["abort", "abort"]


def test_output_kinds_merge_the_sequences_of_a_step(llm):
    engine = llm.engine
    for kind in RequestOutputKind:
        engine.add_request(kind.name, PROMPT, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, n=2,
                                                             seed=9, output_kind=kind))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(o.request_id == kind.name for o in outs)
        if kind is RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1 and [len(c.token_ids) for c in outs[0].outputs] == [5, 5]
        elif kind is RequestOutputKind.DELTA:
            for index in (0, 1):
                tokens = [t for o in outs for c in o.outputs if c.index == index for t in c.token_ids]
                assert len(tokens) == 5
        else:
            assert [len(c.token_ids) for c in outs[-1].outputs] == [5, 5]


def test_async_stream_of_one_parallel_request(llm):
    engine = llm.engine

    async def run():
        async with AsyncLLM(engine) as front:
            params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=2,
                                    output_kind=RequestOutputKind.DELTA)
            texts = {0: "", 1: "", 2: ""}
            finished = []
            async for out in front.generate(PROMPT, params, request_id="par"):
                for c in out.outputs:
                    texts[c.index] += c.text
                finished.append(out.finished)
            assert finished[-1] and not any(finished[:-1])
            return texts

    texts = asyncio.run(run())
    want = llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, n=3, seed=2))[0]
    assert [texts[i] for i in range(3)] == [c.text for c in want.outputs]
