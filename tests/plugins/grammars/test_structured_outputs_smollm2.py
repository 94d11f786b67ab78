"""Structured output on SmolLM2-135M with both grammar engines (slow): constraints hold for greedy and
sampled outputs, and greedy equals transformers greedy under the same grammar mask. One engine per
grammar engine serves both checks (loading SmolLM2 is most of a check's time), and one transformers
oracle serves both grammars."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from grammar_helpers import SPECS, MaskProcessor, check_output
from helpers import assert_all_blocks_free

from framework import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow
PROMPT = "Describe a person as JSON with their name, age, score, pet, tags and home address."
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from framework.model_executor.model_loader import resolve_model_path

    return resolve_model_path("smollm2")


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def grammar_llm(request: pytest.FixtureRequest, smollm2_path: str) -> Iterator:
    """SmolLM2 (float32) under ``grammar=<param>``, shared by this module's tests of that grammar engine;
    every KV block is back in the pool at the end."""
    from framework import LLM

    llm = LLM(model=smollm2_path, dtype="float32", grammar=request.param, max_model_len=512)
    yield llm
    assert_all_blocks_free(llm.engine)


@pytest.fixture(scope="module")
def oracle(smollm2_path: str):
    """transformers' SmolLM2 (float32), loaded once for both grammars."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def test_constraints_hold_on_smollm2(grammar_llm):
    kinds, params = [], []
    # greedy once (a second seed gives the same tokens), sampled once: test_structured_outputs.py samples
    # several seeds on stories260K; here the constraints meet SmolLM2's tokenizer and distribution
    for seed, temperature in ((0, 0.0), (1, 1.0)):
        for kind, spec in SPECS.items():
            kinds.append(kind)
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                                         structured_outputs=StructuredOutputsParams(**{kind: spec})))
    outs = grammar_llm.generate([PROMPT] * len(params), params)
    for kind, out in zip(kinds, outs):
        completion = out.outputs[0]
        assert out.error is None, out.error
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == MAX_TOKENS
            continue
        assert completion.finish_reason == "stop"
        check_output(kind, completion.text)
    assert all(o.outputs[0].finish_reason == "stop" for k, o in zip(kinds, outs) if k in ("regex", "choice", "grammar"))


def test_greedy_matches_transformers_with_same_mask_smollm2(grammar_llm, oracle):
    from transformers import LogitsProcessorList

    llm = grammar_llm
    manager = llm.engine.structured_output
    so = StructuredOutputsParams(json=SPECS["json"])
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so))[0]
    ids = out.prompt_token_ids
    proc = MaskProcessor(manager.grammar, manager.grammar.compile(*so.kind_and_spec()), len(ids), manager.vocab_size)
    with torch.inference_mode():
        seq = oracle.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              logits_processor=LogitsProcessorList([proc]))
    ours, theirs = out.outputs[0].token_ids, seq[0, len(ids):].tolist()
    # llguidance reports termination once only EOS can follow, so the engine may stop one EOS earlier
    assert theirs[:len(ours)] == ours and (theirs[len(ours):] == [] or (len(theirs) == len(ours) + 1 and theirs[-1] in llm.engine.eos_token_ids))
