"""Worker-side per-request fault isolation (issue 44): an exception in a per-request site of the driver
rank's runner (grammar bitmask application, the sampler and its stages, the rejection sampler) fails
only the request concerned (``finish_reason="abort"``, ``internal_error``, the error naming the site),
as the driver-side ``RequestFaults`` do; every other request of the batch, seeded random ones
included, gets exactly the tokens of a run without the fault, and the engine keeps serving. Faults
are injected through ``collective_rpc`` (``framework.testing.fault_injection``), so the same test
reaches a worker process (``executor=mp``, two ranks)."""

from __future__ import annotations

import json

import pytest
from helpers import STORIES, STORY_PROMPTS

from framework import LLM, SamplingParams, StructuredOutputsParams, registry
from framework.testing import faulty_plugins
from framework.testing.fault_injection import clear_worker_faults, inject_worker_fault
from framework.testing.faulty_plugins import FAULT_STOP

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
#: what makes a poisoned request reach each site
REACHES = {"sampler": {}, "min_tokens": {"min_tokens": 3}, "logit_bias": {"logit_bias": {5: 0.5}},
           "penalties": {"repetition_penalty": 1.2}, "top_k_top_p": {"temperature": 0.8, "top_k": 5, "seed": 3},
           "grammar_bitmask": {"structured_outputs": StructuredOutputsParams(json=json.dumps(SCHEMA))}}


def _normal() -> list[SamplingParams]:
    """The requests the fault must not touch: greedy, seeded random, penalized, constrained."""
    return [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(
                json=json.dumps(SCHEMA)))]


def _run(llm: LLM, poisoned: SamplingParams | None) -> tuple[list, object]:
    """(token ids of the normal requests, the poisoned request's output or None); the poisoned request
    sits in the middle of the batch."""
    params = _normal()
    prompts = STORY_PROMPTS[:len(params)]
    if poisoned is None:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], None
    outs = llm.generate(prompts[:2] + ["The dog"] + prompts[2:], params[:2] + [poisoned] + params[2:])
    return [o.outputs[0].token_ids for o in outs[:2] + outs[3:]], outs[2]


def _check(llm: LLM, site: str, baseline: list, what: str) -> None:
    llm.engine.executor.collective_rpc(inject_worker_fault, args=(site,))
    try:
        poisoned = SamplingParams(**{"temperature": 0.0, "max_tokens": 10, "stop": [FAULT_STOP], **REACHES[site]})
        tokens, bad = _run(llm, poisoned)
    finally:
        llm.engine.executor.collective_rpc(clear_worker_faults)
    assert tokens == baseline, site
    assert bad.finished and bad.outputs[0].finish_reason == "abort" and bad.internal_error, site
    assert f"{what} on worker rank 0 failed on this request" in bad.error and "InjectedFault" in bad.error, bad.error
    assert site in bad.error, bad.error
    assert _run(llm, None)[0] == baseline  # the engine goes on


@pytest.fixture(scope="module")
def uniproc_llm():
    llm = LLM(model=STORIES, attention="torch", max_model_len=128)
    yield llm, _run(llm, None)[0]
    llm.engine.shutdown()


@pytest.mark.parametrize("site", list(REACHES))
def test_worker_site_fault_fails_only_its_request(uniproc_llm, site):
    llm, baseline = uniproc_llm
    _check(llm, site, baseline, "sampler")


def test_rejection_sampler_fault_fails_only_its_request():
    """Verification of drafts: the faulty drafter proposes k copies of the last token for every request
    (it fails only on ``FAULT_STOP``; this fault uses another marker), the rejection sampler raises on
    the poisoned request."""
    marker = "<worker-fault>"
    with registry.registered(faulty_plugins, name="faulty-plugins"):
        llm = LLM(model=STORIES, attention="torch", max_model_len=128, drafter="faulty")
        baseline = _run(llm, None)[0]
        llm.engine.executor.collective_rpc(inject_worker_fault, args=("rejection_sampler", marker))
        try:
            tokens, bad = _run(llm, SamplingParams(temperature=0.0, max_tokens=10, stop=[marker]))
        finally:
            llm.engine.executor.collective_rpc(clear_worker_faults)
    assert tokens == baseline
    assert bad.outputs[0].finish_reason == "abort" and "rejection sampler on worker rank 0" in bad.error
    assert llm.engine.metrics.summary()["spec_num_draft_tokens"] > 0


def test_worker_process_site_fault_fails_only_its_request():
    """The same guard in a worker process of ``executor=mp`` at two ranks (the fault injected by reference)."""
    llm = LLM(model=STORIES, attention="torch", max_model_len=128, executor="mp", tensor_parallel_size=2)
    try:
        _check(llm, "penalties", _run(llm, None)[0], "sampler")
        llm.engine.check_health()
    finally:
        llm.engine.shutdown()
