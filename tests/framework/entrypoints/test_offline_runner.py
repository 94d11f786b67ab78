"""The offline run loop against a fake engine (no model): records, rejections, arrivals, summary."""

from __future__ import annotations

import time

import pytest

from framework.core.clock import WALL_CLOCK
from framework.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from framework.core.sampling_params import SamplingParams
from framework.entrypoints.offline_runner import run_workload
from framework.metrics.collector import MetricsCollector
from framework.workloads.item import WorkloadItem


class FakeEngine:
    """Emits one token per request per step; finishes at max_tokens; rejects prompts over 5 tokens."""

    max_model_len = 5
    clock = WALL_CLOCK

    def __init__(self):
        self.metrics = MetricsCollector()
        self.active: dict[str, dict] = {}
        self.added: list[tuple[str, object, SamplingParams, int, float]] = []
        self.planned: list[list[int] | None] = []  # the budgets maybe_compile was told, before any request

    def maybe_compile(self, planned_budgets, repeats=1):
        assert not self.added, "compile decided after requests were added"
        self.planned.append(planned_budgets)

    def tokenize(self, prompt):
        return [ord(c) for c in prompt]

    def add_request(self, request_id, prompt, sampling_params, priority=0, arrival_time=None, client_id=None,
                    lora_request=None):
        ids = prompt if isinstance(prompt, list) else [ord(c) for c in prompt]
        if len(ids) > 5:
            raise ValueError("prompt has too many tokens; max_model_len is 5")
        self.added.append((request_id, prompt, sampling_params, priority, arrival_time))
        self.active[request_id] = {"ids": ids, "params": sampling_params, "out": []}

    def has_unfinished_requests(self):
        return bool(self.active)

    def step(self):
        outputs = []
        for rid, state in list(self.active.items()):
            state["out"].append(7)
            done = len(state["out"]) >= state["params"].max_tokens
            metrics = None
            if done:
                del self.active[rid]
                metrics = RequestMetrics(ttft_s=0.01, tpot_s=0.001, itl_s=[], e2e_s=0.02, queue_s=0.0,
                                         num_prompt_tokens=len(state["ids"]), num_output_tokens=len(state["out"]),
                                         num_cached_tokens=0, num_preemptions=0)
            completion = CompletionOutput(index=0, text="x" * len(state["out"]), token_ids=list(state["out"]),
                                          finish_reason="length" if done else None)
            output = RequestOutput(request_id=rid, prompt=None, prompt_token_ids=state["ids"], outputs=[completion],
                                   finished=done, metrics=metrics)
            if done:
                self.metrics.observe_finished(output)
            outputs.append(output)
        return outputs


def test_records_in_input_order_with_rejections(caplog):
    engine = FakeEngine()
    items = [WorkloadItem("a", prompt="hi", max_tokens=3), WorkloadItem("b", prompt="far too long"),
             WorkloadItem("c", prompt=None, prompt_token_ids=[5, 6], priority=2)]
    records, summary = run_workload(engine, items, SamplingParams(temperature=0.0, max_tokens=2), progress=False)
    assert [r["request_id"] for r in records] == ["a", "b", "c"]
    assert engine.planned == [[3, 2, 2]]  # each request's budget, told once before the run
    a, b, c = records
    assert a["token_ids"] == [7, 7, 7] and a["finish_reason"] == "length" and a["error"] is None
    assert a["metrics"]["num_output_tokens"] == 3 and a["text"] == "xxx" and a["prompt"] == "hi"
    assert b["finish_reason"] == "abort" and "max_model_len" in b["error"] and b["metrics"] is None
    assert c["token_ids"] == [7, 7]
    assert "b" in caplog.text and "rejected" in caplog.text
    # token ids win over text; priority and per-item max_tokens are passed through
    added = {rid: (prompt, params, prio) for rid, prompt, params, prio, _ in engine.added}
    assert added["c"][0] == [5, 6] and added["c"][2] == 2
    assert added["a"][1].max_tokens == 3 and added["c"][1].max_tokens == 2 and added["a"][1] is not added["c"][1]
    assert summary["num_requests"] == 2 and summary["num_rejected"] == 1 and summary["total_output_tokens"] == 5
    assert summary["duration_s"] > 0


def test_arrival_offsets_delay_submission():
    engine = FakeEngine()
    items = [WorkloadItem("late", prompt="a", max_tokens=1, arrival_time_s=0.2),
             WorkloadItem("early", prompt="b", max_tokens=1)]
    start = time.perf_counter()
    records, _ = run_workload(engine, items, SamplingParams(max_tokens=1), progress=True)
    assert time.perf_counter() - start >= 0.2
    assert [r["request_id"] for r in records] == ["late", "early"]
    arrivals = {rid: t for rid, *_, t in engine.added}
    assert [rid for rid, *_ in engine.added] == ["early", "late"]
    assert arrivals["late"] - arrivals["early"] == pytest.approx(0.2)


def test_duplicate_ids_rejected():
    with pytest.raises(ValueError, match="unique"):
        run_workload(FakeEngine(), [WorkloadItem("a", prompt="x"), WorkloadItem("a", prompt="y")],
                     SamplingParams(), progress=False)
