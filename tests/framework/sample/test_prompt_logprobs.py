"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's field and shape) against transformers'
``log_softmax`` of the prompt in float32: whole prefills, chunked prefills, a prompt whose blocks are in
the prefix cache (the request skips the cache, so nothing is lost), a recompute after preemption, DELTA
outputs, and the compiled decoder (whose LM head runs on ``logits_index`` rows only)."""

from __future__ import annotations

import pytest
import torch
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS, assert_all_blocks_free

from framework import LLM, SamplingParams
from framework.core.sampling_params import RequestOutputKind

TOL = 1e-4
_REF: dict[tuple[int, ...], torch.Tensor] = {}


def reference(ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-probabilities of the prompt, ``(len(ids), vocab)``: row ``t`` predicts ``t + 1``."""
    from transformers import AutoModelForCausalLM

    if "model" not in _REF:
        _REF["model"] = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    key = tuple(ids)
    if key not in _REF:
        with torch.inference_mode():
            _REF[key] = _REF["model"](torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return _REF[key]


def assert_prompt_logprobs(ids: list[int], got: list, k: int) -> None:
    """vLLM's shape (``None`` first, one dict per later token holding the token and the top ``k``) and
    transformers' values within ``TOL``."""
    ref = reference(ids)
    assert got[0] is None and len(got) == len(ids)
    for t in range(1, len(ids)):
        entry = got[t]
        assert ids[t] in entry and len(entry) in (k, k + 1)
        top = ref[t - 1].topk(k)
        assert set(top.indices.tolist()) <= set(entry), f"token {t}: top-{k} ids differ"
        for tid, lp in entry.items():
            assert abs(lp - ref[t - 1, tid].item()) < TOL, f"token {t} id {tid}: {lp} vs {ref[t - 1, tid].item()}"


@pytest.fixture(scope="module")
def llm():
    """Chunked prefill: 24-token budget, 8-token chunks per request, 4-token blocks."""
    engine = LLM(model=STORIES, dtype="float32", compile=False, block_size=4, num_blocks=512,
                 max_num_batched_tokens=24, long_prefill_token_threshold=8)
    yield engine
    assert_all_blocks_free(engine.engine)


def _ids(llm, prompts):
    return [llm.get_tokenizer()(p).input_ids for p in prompts]


def test_whole_and_chunked_prefills_equal_transformers(llm):
    ids = _ids(llm, STORY_PROMPTS[:6])
    assert max(len(i) for i in ids) > 24  # several chunks, several steps
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4))
    for i, out in zip(ids, outs):
        assert_prompt_logprobs(i, out.prompt_logprobs, 4)
        assert out.outputs[0].logprobs is None  # sampled-token logprobs are a separate field
    plain = llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prefix_cache_hit_keeps_every_logprob(llm):
    """The prompts' blocks are cached by a first run; a request asking for prompt logprobs skips the cache
    (recomputes its prompt) and gets every token's logprob, while one that does not ask still hits."""
    ids = _ids(llm, PREFIX_PROMPTS[:3])
    llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=2))
    cached = llm.generate([{"prompt_token_ids": ids[0]}], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert cached.num_cached_tokens >= 4 * ((len(ids[0]) - 1) // 4) - 4  # the blocks are there to hit
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    for i, out in zip(ids, outs):
        assert out.num_cached_tokens == 0
        assert_prompt_logprobs(i, out.prompt_logprobs, 0)
        assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k = 0: the prompt token's own


def test_recompute_after_preemption_records_each_token_once(make_llm):
    """A KV pool too small for the batch preempts (recompute) mid-prefill; the prefill runs again and the
    logprobs it recomputes are not recorded twice."""
    small = make_llm(dtype="float32", compile=False, block_size=4, num_blocks=40, max_model_len=128,
                     max_num_batched_tokens=32, long_prefill_token_threshold=8)
    ids = _ids(small, STORY_PROMPTS[:8])
    outs = small.generate([{"prompt_token_ids": i} for i in ids],
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2))
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    for i, out in zip(ids, outs):
        assert_prompt_logprobs(i, out.prompt_logprobs, 2)


def test_delta_outputs_carry_prompt_logprobs_once(llm):
    engine = llm.engine
    ids = _ids(llm, [STORY_PROMPTS[5]])[0]
    engine.add_request("delta", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1,
                                                    output_kind=RequestOutputKind.DELTA))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False, False]
    assert_prompt_logprobs(ids, outs[0].prompt_logprobs, 1)


def test_validation():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.slow
def test_compiled_decoder_gives_the_same_prompt_logprobs():
    """``engine.compile=true``: the compiled decoder's LM head runs on ``logits_index``, which holds the
    prompt rows too; no graph is compiled past the warm-up (the extra rows never reach the graph)."""
    llm = LLM(model=STORIES, dtype="float32", compile=True, block_size=8, max_num_batched_tokens=24,
              long_prefill_token_threshold=16)
    ids = _ids(llm, STORY_PROMPTS[:4])
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3))
    for i, out in zip(ids, outs):
        assert_prompt_logprobs(i, out.prompt_logprobs, 3)
    summary = llm.engine.metrics.summary()
    assert summary["compile_active"] and summary["compile_num_recompiles"] == 0
    assert_all_blocks_free(llm.engine)
