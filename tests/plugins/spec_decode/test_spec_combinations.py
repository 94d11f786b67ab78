"""Speculative decoding combined with the other capabilities: swap preemption (outputs equal
transformers greedy and the non-speculative run) and structured outputs (constrained requests in a
speculating batch are never drafted for, still satisfy their constraint and equal the grammar-only
run, while unconstrained requests in the same batch keep speculating)."""

from __future__ import annotations

import pytest
from grammar_helpers import SPECS, check_output
from helpers import STORIES, STORIES_DRAFT, hf_greedy

from framework import SamplingParams, StructuredOutputsParams

PROMPTS = ["Once upon a time", "Lily and Tom went to the park. Lily and Tom went to the park. Lily and",
           "The dog ran to the park and", "There was a cat. The cat was big. The cat"]
EXTRA = {"ngram": {}, "draft_model": {"model": STORIES_DRAFT}}


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_spec_decode_with_swap_preemption(make_llm, drafter):
    llm = make_llm(drafter=drafter, drafter_params={"num_speculative_tokens": 3, **EXTRA[drafter]},
                   num_blocks=12, block_size=16, max_model_len=160, enable_prefix_caching=False, preemption_mode="swap",
                   swap_space_bytes=1 << 22)
    freed: list[str] = []
    on_requests_freed = llm.engine.drafter.on_requests_freed

    def recording(request_ids):
        freed.extend(request_ids)
        on_requests_freed(request_ids)

    llm.engine.drafter.on_requests_freed = recording
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS + PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=96))
    expected = hf_greedy(STORIES, ids, 96)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers under spec x swap"
    summary = llm.engine.metrics.summary()
    assert summary["num_preemptions_swap"] > 0, "no swap preemption happened: the test checks nothing"
    assert summary["spec_num_draft_tokens"] > 0 and summary["spec_num_accepted_tokens"] > 0
    # preempted (swapped) and finished requests are reported to the drafter: more calls than requests
    assert {o.request_id for o in outs} <= set(freed) and len(freed) > len(outs)
    draft_kv = getattr(llm.engine.drafter, "kv", None)
    if draft_kv is not None:
        assert draft_kv.num_free_blocks == draft_kv.num_blocks, "draft KV blocks leaked"


def test_spec_decode_with_structured_outputs(make_llm):
    constrained = [SamplingParams(temperature=0.0, max_tokens=200,
                                  structured_outputs=StructuredOutputsParams(**{kind: SPECS[kind]}))
                   for kind in ("regex", "choice")]
    free = SamplingParams(temperature=0.0, max_tokens=40)
    params = [constrained[0], free, constrained[1], free]
    spec = make_llm(grammar="xgrammar", drafter="ngram", drafter_params={"num_speculative_tokens": 3})
    plain = make_llm(grammar="xgrammar")
    drafted_for: set[str] = set()
    propose = spec.engine.drafter.propose

    def recording_propose(requests):
        drafted_for.update(r.request_id for r in requests if r.sampling_params.structured_outputs is not None)
        return propose(requests)

    spec.engine.drafter.propose = recording_propose
    outs = spec.generate(PROMPTS, params)
    ref = plain.generate(PROMPTS, params)
    assert not drafted_for, f"constrained requests were drafted for: {drafted_for}"
    for kind, i in (("regex", 0), ("choice", 2)):
        assert outs[i].error is None and outs[i].outputs[0].finish_reason == "stop"
        check_output(kind, outs[i].outputs[0].text)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert spec.engine.metrics.summary()["spec_num_draft_tokens"] > 0, "the free requests never speculated"
