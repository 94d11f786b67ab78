"""The engine calls the lifecycle hooks: on_engine_start once, on_step_end per step, on_request_finished
once per request (the hooks trackers and the dashboard are fed by)."""

from __future__ import annotations

from framework import SamplingParams, hookimpl, registry


class Recorder:
    def __init__(self) -> None:
        self.started, self.steps, self.finished = [], [], []

    @hookimpl
    def on_engine_start(self, config):
        self.started.append(config)

    @hookimpl
    def on_step_end(self, stats):
        self.steps.append(stats)

    @hookimpl
    def on_request_finished(self, output):
        self.finished.append(output.request_id)


def test_engine_calls_lifecycle_hooks(make_llm):
    recorder = Recorder()
    with registry.registered(recorder):
        llm = make_llm()
        outputs = llm.generate(["Once upon a time", "The dog"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(recorder.started) == 1 and recorder.started[0]["scheduler"] == "fcfs"
    assert sorted(recorder.finished) == sorted(o.request_id for o in outputs)
    assert [s.step for s in recorder.steps] == list(range(len(recorder.steps))) and len(recorder.steps) >= 3
    assert sum(s.num_generated_tokens for s in recorder.steps) == 6
