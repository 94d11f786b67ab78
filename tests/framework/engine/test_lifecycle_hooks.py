"""The engine calls the lifecycle hooks: on_engine_start once, on_step_end per step, on_request_finished
once per request (the hooks trackers and the dashboard are fed by)."""

from __future__ import annotations

from helpers import HookRecorder

from framework import SamplingParams, registry


def test_engine_calls_lifecycle_hooks(make_llm):
    recorder = HookRecorder()
    with registry.registered(recorder):
        llm = make_llm()
        outputs = llm.generate(["Once upon a time", "The dog"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(recorder.started) == 1 and recorder.started[0]["scheduler"] == "fcfs"
    assert sorted(recorder.finished) == sorted(o.request_id for o in outputs)
    assert [s.step for s in recorder.steps] == list(range(len(recorder.steps))) and len(recorder.steps) >= 3
    assert sum(s.num_generated_tokens for s in recorder.steps) == 6
