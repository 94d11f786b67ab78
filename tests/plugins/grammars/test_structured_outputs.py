"""Structured output end to end on stories260K, both grammar engines: every output satisfies its
constraint (JSON schema via jsonschema, regex fullmatch, choice membership, EBNF via the grammar),
greedy equals transformers greedy under the same mask, and bad constraints fail only their request."""

from __future__ import annotations

import pytest
import torch
from grammar_helpers import CHOICES, PROMPTS, SPECS, MaskProcessor, check_output
from helpers import STORIES

from framework import SamplingParams, StructuredOutputsParams

ENGINES = ["xgrammar", "llguidance"]
MAX_TOKENS = 200  # enough for every constraint to close on stories260K's 512-token vocabulary
@pytest.mark.parametrize("grammar", ENGINES)
def test_every_output_satisfies_its_constraint(make_llm, grammar):
    llm = make_llm(model=STORIES, grammar=grammar)
    prompts, params, kinds = [], [], []
    for seed in range(3):
        for temperature in (0.0, 1.0):
            for kind, spec in SPECS.items():
                prompts.append(PROMPTS[seed])
                params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                                             structured_outputs=StructuredOutputsParams(**{kind: spec})))
                kinds.append(kind)
    outs = llm.generate(prompts, params)
    for kind, out in zip(kinds, outs):
        completion = out.outputs[0]
        assert out.error is None
        if completion.finish_reason == "length":  # truncated: reported, and a valid prefix
            assert len(completion.token_ids) == MAX_TOKENS
            continue
        assert completion.finish_reason == "stop", (kind, completion)
        check_output(kind, completion.text)
    stopped = {k for k, o in zip(kinds, outs) if o.outputs[0].finish_reason == "stop"}
    assert stopped >= {"json", "regex", "choice", "grammar"}, [(k, o.outputs[0]) for k, o in zip(kinds, outs)]
    assert all(o.outputs[0].finish_reason == "stop" for k, o in zip(kinds, outs) if k in ("regex", "choice", "grammar"))


@pytest.mark.parametrize("grammar", ENGINES)
def test_greedy_matches_transformers_with_same_mask(make_llm, grammar):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    llm = make_llm(model=STORIES, grammar=grammar)
    manager = llm.engine.structured_output
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    for kind in ("json", "regex", "grammar"):
        so = StructuredOutputsParams(**{kind: SPECS[kind]})
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so))[0]
        ids = out.prompt_token_ids
        compiled = manager.grammar.compile(*so.kind_and_spec())
        proc = MaskProcessor(manager.grammar, compiled, len(ids), manager.vocab_size)
        with torch.inference_mode():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 logits_processor=LogitsProcessorList([proc]))
        ours, theirs = list(out.outputs[0].token_ids), seq[0, len(ids):].tolist()
        # llguidance reports termination once only EOS can follow, so the engine may stop one EOS earlier
        assert theirs[:len(ours)] == ours, kind
        assert theirs[len(ours):] == [] or (grammar == "llguidance" and len(theirs) == len(ours) + 1
                                            and theirs[-1] in llm.engine.eos_token_ids), kind


@pytest.mark.parametrize("grammar", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("bad", [{"regex": "(ab"}, {"grammar": "root ::= missing_rule"},
                                 {"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}])
def test_malformed_constraint_fails_only_its_request(make_llm, grammar, bad):
    llm = make_llm(model=STORIES, grammar=grammar)
    good = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    plain = SamplingParams(temperature=0.0, max_tokens=8)
    bad_params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(**bad))
    outs = llm.generate(PROMPTS, [good, bad_params, plain])
    assert outs[0].outputs[0].text in CHOICES and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].finish_reason == "abort" and grammar in outs[1].error
    assert outs[1].outputs[0].token_ids == []
    assert outs[2].outputs[0].finish_reason in ("stop", "length") and outs[2].error is None


def test_compile_cache_reuses_compiled_grammar(make_llm):
    llm = make_llm(model=STORIES)
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    llm.generate(PROMPTS, params)
    manager = llm.engine.structured_output
    assert len(manager._cache) == 1 and not manager.matchers and manager.num_pending == 0


def test_grammar_none_refuses_structured_requests(make_llm):
    llm = make_llm(model=STORIES, grammar="none")
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="grammar=xgrammar"):
        llm.engine.add_request("r0", "Hi", params)
    assert not llm.engine.has_unfinished_requests()


def test_abort_while_compiling_frees_everything(make_llm):
    llm = make_llm(model=STORIES)
    llm.engine.add_request("r0", "Hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    llm.engine.abort_request("r0")
    assert not llm.engine.has_unfinished_requests() and "r0" not in llm.engine.structured_output


@pytest.mark.parametrize("grammar", ENGINES)
def test_matcher_validate_and_rollback_for_spec_decode(make_llm, grammar):
    llm = make_llm(model=STORIES, grammar=grammar)
    manager = llm.engine.structured_output
    tok = llm.engine.tokenizer
    matcher = manager.grammar.matcher(manager.grammar.compile("regex", "abcabc"))
    good = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in b"abcabc"]
    draft = good[:3] + [tok.convert_tokens_to_ids("<0x7A>")] + good[4:]  # "abcz.." rejected at 3
    assert matcher.validate_tokens(draft) == 3
    assert matcher.validate_tokens(good) == 6  # nothing advanced by the previous call
    assert all(matcher.accept_token(t) for t in good[:5])
    matcher.rollback(2)  # back to "abc"
    assert matcher.validate_tokens(good[3:]) == 3 and not matcher.accept_token(good[1])
    assert all(matcher.accept_token(t) for t in good[3:])
    # xgrammar terminates on EOS; llguidance as soon as only EOS can follow (the engine then stops
    # without feeding it more tokens)
    if grammar == "xgrammar":
        assert not matcher.is_terminated() and matcher.accept_token(2)
    assert matcher.is_terminated()


def test_fill_draft_bitmask_rows_and_state_unchanged(make_llm):
    llm = make_llm(model=STORIES)
    manager = llm.engine.structured_output
    tok = llm.engine.tokenizer
    ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in b"abz"]
    manager.matchers["r"] = manager.grammar.matcher(manager.grammar.compile("regex", "abc"))
    bitmask = torch.zeros(4, manager.num_words, dtype=torch.int32)
    assert manager.fill_draft_bitmask(bitmask, 0, "r", ids) == 2  # "z" is not allowed after "ab"

    def allowed(row):
        return [t for t in range(manager.vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]

    c = tok.convert_tokens_to_ids("<0x63>")
    assert ids[0] in allowed(0) and ids[1] in allowed(1) and c in allowed(2) and ids[2] not in allowed(2)
    assert not bitmask[3].any()  # rows past n untouched
    assert manager.matchers["r"].validate_tokens(ids[:2] + [c]) == 3  # state rolled back to the start
    manager.discard("r")
