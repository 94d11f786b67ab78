"""Speculative decoding combined with the other capabilities: swap preemption (outputs equal
transformers greedy and the non-speculative run) and structured outputs (drafts of constrained requests are validated against
the grammar, verify rows are masked, and outputs satisfy their constraint and equal the grammar-only
run, next to unconstrained requests speculating in the same batch)."""

from __future__ import annotations

import pytest
from grammar_helpers import SPECS, check_output
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE, hf_greedy

from framework import SamplingParams, StructuredOutputsParams

PROMPTS = ["Once upon a time", "Lily and Tom went to the park. Lily and Tom went to the park. Lily and",
           "The dog ran to the park and", "There was a cat. The cat was big. The cat"]
EXTRA = {"ngram": {}, "draft_model": {"model": STORIES_DRAFT}, "eagle": {"model": STORIES_EAGLE}}


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle"])
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


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle"])
def test_spec_decode_with_structured_outputs(make_llm, drafter):
    """Drafts of constrained requests are cut to their grammar-valid prefix and every verify row is
    masked with the grammar state after the drafts before it; outputs satisfy the constraints and
    equal the grammar-only (non-speculative) run token for token (greedy)."""
    constrained = [SamplingParams(temperature=0.0, max_tokens=200,
                                  structured_outputs=StructuredOutputsParams(**{kind: SPECS[kind]}))
                   for kind in ("regex", "choice", "grammar")]
    free = SamplingParams(temperature=0.0, max_tokens=40)
    prompts = PROMPTS + PROMPTS[:2]
    kinds = ["regex", None, "choice", None, "grammar", None]
    params = [constrained[0], free, constrained[1], free, constrained[2], free]
    spec = make_llm(grammar="xgrammar", drafter=drafter,
                    drafter_params={"num_speculative_tokens": 3, **EXTRA[drafter]})
    plain = make_llm(grammar="xgrammar")
    manager = spec.engine.structured_output
    masked = {"verify_rows": 0}
    fill_draft_bitmask = manager.fill_draft_bitmask  # the driver's bitmask rows of a verifying request

    def recording(bitmask, first_row, request_id, drafts):
        masked["verify_rows"] += len(drafts) + 1
        # drafts were cut to their grammar-valid prefix when proposed
        assert manager.matchers[request_id].validate_tokens(drafts) == len(drafts), (request_id, drafts)
        return fill_draft_bitmask(bitmask, first_row, request_id, drafts)

    manager.fill_draft_bitmask = recording
    outs = spec.generate(prompts, params)
    ref = plain.generate(prompts, params)
    for kind, out in zip(kinds, outs):
        if kind is not None:
            assert out.error is None and out.outputs[0].finish_reason == "stop", out.outputs[0]
            check_output(kind, out.outputs[0].text)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert masked["verify_rows"] > 0, "no constrained request verified drafts: the test checks nothing"
    assert spec.engine.metrics.summary()["spec_num_accepted_tokens"] > 0
