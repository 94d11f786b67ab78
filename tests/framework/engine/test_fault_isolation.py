"""Per-request fault isolation (issue 34): a plugin (or the detokenizer) that raises on one request fails that
request only (``finish_reason="abort"``, an error naming the plugin, blocks freed); the other requests of the
batch finish with exactly the outputs of a run without the faulty plugin, and the engine keeps serving. A fault
of the step itself (the model forward) kills the engine with ``EngineDeadError``.

Also the crash of the issue: SentencePiece byte fallback + sampling at temperature 1.0 (``DecodeStream``'s
"Invalid prefix"), on a random-weight model, offline."""

from __future__ import annotations

import json

import pytest
from helpers import STORIES, STORY_PROMPTS

from framework import SamplingParams, hookimpl, registry
from framework.core.faults import EngineDeadError
from framework.core.structured_output_params import StructuredOutputsParams
from framework.testing import faulty_plugins
from framework.testing.faulty_plugins import FAULT_STOP, FaultyObserver

PROMPTS = STORY_PROMPTS[:4]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
POISONED_SCHEMA = {**SCHEMA, "description": FAULT_STOP}  # same constraint; the faulty grammar fails on it


def _normal() -> list[SamplingParams]:
    """Greedy requests the faults must not touch: plain ones and one constrained by a sound schema."""
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in PROMPTS]
    structured = SamplingParams(temperature=0.0, max_tokens=24,
                                structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    return plain + [structured]


def _generate(llm, poisoned: list[SamplingParams]) -> tuple[list, list]:
    """(normal outputs, poisoned outputs); the poisoned requests sit in the middle of the batch."""
    prompts, params, k = PROMPTS + ["Lily"], _normal(), len(poisoned)
    outs = llm.generate(prompts[:2] + ["The dog"] * k + prompts[2:], params[:2] + poisoned + params[2:])
    return outs[:2] + outs[2 + k:], outs[2:2 + k]


@pytest.fixture(scope="module")
def baseline():
    """Token ids of the normal requests without any faulty plugin."""
    from framework import LLM

    llm = LLM(model=STORIES)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS + ["Lily"], _normal())]


@pytest.fixture
def faulty():
    with registry.registered(faulty_plugins, name="faulty-plugins"):
        yield


def _check(outs: list, poisoned_outs: list, baseline: list, names: str, cause: str = "InjectedFault") -> None:
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert all(o.error is None and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    for out in poisoned_outs:
        assert out.finished and out.outputs[0].finish_reason == "abort" and out.internal_error
        assert names in out.error and cause in out.error, out.error


GRAMMAR_CASES = ["compile", "matcher", "fill_bitmask", "accept_token", "is_terminated", "validate_tokens"]


@pytest.mark.parametrize("fail_in", GRAMMAR_CASES)
def test_grammar_fault_fails_only_its_request(make_llm, faulty, baseline, fail_in):
    spec = {"drafter": "faulty"} if fail_in == "validate_tokens" else {}  # validate_tokens: drafts only
    llm = make_llm(grammar="faulty", grammar_params={"fail_in": fail_in}, **spec)
    poisoned = SamplingParams(temperature=0.0, max_tokens=24,
                              structured_outputs=StructuredOutputsParams(json=json.dumps(POISONED_SCHEMA)))
    outs, bad = _generate(llm, [poisoned])
    _check(outs, bad, baseline, "grammar 'faulty'")
    outs, _ = _generate(llm, [])  # the engine goes on
    assert [o.outputs[0].token_ids for o in outs] == baseline


@pytest.mark.parametrize("fail_in", ["propose", "out_of_vocab"])
def test_drafter_fault_fails_only_its_request(make_llm, faulty, baseline, fail_in):
    """A batched ``propose`` that raises is retried per request: only the culprits fail."""
    llm = make_llm(drafter="faulty", drafter_params={"fail_in": fail_in})
    poisoned = [SamplingParams(temperature=0.0, max_tokens=12, stop=[FAULT_STOP]) for _ in range(2)]
    outs, bad = _generate(llm, poisoned)
    _check(outs, bad, baseline, "drafter 'faulty'", "InjectedFault" if fail_in == "propose" else "token id -1")
    assert all(len(o.outputs[0].token_ids) >= 1 for o in bad)  # they ran (first token) before the drafter failed
    assert llm.engine.metrics.summary()["spec_num_draft_tokens"] > 0  # the sound requests kept speculating


def test_detokenizer_fault_fails_only_its_request(make_llm, baseline, monkeypatch):
    from framework.core.detokenizer import IncrementalDetokenizer

    append = IncrementalDetokenizer.append

    def failing(self, token_id, check_stop=True):
        if FAULT_STOP in self.stop:
            raise faulty_plugins.InjectedFault("detokenizer")
        return append(self, token_id, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "append", failing)
    llm = make_llm()
    outs, bad = _generate(llm, [SamplingParams(temperature=0.0, max_tokens=12, stop=[FAULT_STOP])])
    _check(outs, bad, baseline, "stop checker (detokenizer")


def test_lifecycle_hook_faults_are_logged_once_and_isolated(make_llm, baseline, caplog):
    """Hooks that raise on every call: the engine, the outputs and the next observer are unaffected."""
    class Recorder:
        def __init__(self) -> None:
            self.steps, self.finished = 0, 0

        @hookimpl
        def on_step_end(self, stats):
            self.steps += 1

        @hookimpl
        def on_request_finished(self, output):
            self.finished += 1

    broken, recorder = FaultyObserver(every=1), Recorder()
    with registry.registered(broken, name="broken-observer"), registry.registered(recorder):
        llm = make_llm()
        outs, _ = _generate(llm, [])
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert broken.calls["on_engine_start"] == 1 and broken.calls["on_request_finished"] == len(outs)
    assert recorder.finished == len(outs) and recorder.steps == broken.calls["on_step_end"] > 1
    logged = [r for r in caplog.records if "broken-observer" in r.getMessage() and r.levelname == "ERROR"]
    assert len(logged) == 3  # once per hook, not once per call


def test_forward_fault_kills_the_engine(make_llm, monkeypatch):
    """The model forward raising leaves engine state unknown: LLM.generate raises EngineDeadError and refuses
    later work (a per-request guard must never swallow it)."""
    llm = make_llm()
    monkeypatch.setattr(llm.engine.runner, "_forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(EngineDeadError, match="boom") as info:
        llm.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EngineDeadError, match="build a new LLM"):
        llm.generate(PROMPTS[:1])
    for rid in list(llm.engine.scheduler.requests):  # leave the pool clean for make_llm's leak check
        llm.engine.abort_request(rid)


def test_byte_fallback_sampling_on_random_weights_offline(make_llm, random_weight_stories):
    """Issue 34's crash: a random-weight model with the stories260K tokenizer (SentencePiece byte fallback) sampling
    at temperature 1.0 emits invalid byte runs that made DecodeStream raise and lost the whole batch."""
    llm = make_llm(model=random_weight_stories)
    params = [SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=i, stop=["zz"] if i % 2 else [])
              for i in range(8)]
    outs = llm.generate(STORY_PROMPTS[:8], params)
    assert all(o.error is None and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    assert sum("\ufffd" in o.outputs[0].text for o in outs) >= 1  # the invalid byte runs did occur


@pytest.mark.parametrize("drafter", ["none", "ngram"])
@pytest.mark.parametrize("case", ["empty_language", "min_tokens_conflict"])
def test_unsatisfiable_constraint_is_a_rejection(make_llm, baseline, drafter, case):
    """Found by the request fuzzer: a grammar whose language is empty (``root ::= root``), or a choice that must
    end while ``min_tokens`` masks EOS: the bitmask row allows no samplable token, the sampled token violated the
    grammar and was reported as a server fault. It is the request's own error (``internal_error`` false: HTTP
    400), found from the bitmask row before sampling."""
    llm = make_llm(drafter=drafter)
    if case == "empty_language":
        dead = SamplingParams(temperature=0.0, max_tokens=8,
                              structured_outputs=StructuredOutputsParams(grammar="root ::= root"))
    else:
        dead = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5,
                              structured_outputs=StructuredOutputsParams(choice=["a"]))
    outs, bad = _generate(llm, [dead])
    assert [o.outputs[0].token_ids for o in outs] == baseline
    assert bad[0].outputs[0].finish_reason == "abort" and not bad[0].internal_error
    assert ("allows no token" if case == "empty_language" else "min_tokens=5 forbids") in bad[0].error
