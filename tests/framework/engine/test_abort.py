"""Abort at every point of an engine step (issue 7): before scheduling, between ``schedule()`` and
``update_from_output()``, mid-prefill, after preemption, after finishing, and through the engine.

Model-free scheduler tests reuse the fake runner of ``test_scheduler``; one engine test uses stories260K.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from framework.core.outputs import ModelRunnerOutput
from framework.core.request import RequestStatus
from framework.core.sampling_params import SamplingParams

_spec = importlib.util.spec_from_file_location("_sched_helpers", Path(__file__).parents[1] / "core" / "test_scheduler.py")
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
TOKEN, check_pool, fake_runner = _helpers.TOKEN, _helpers.check_pool, _helpers.fake_runner
make_request, make_scheduler = _helpers.make_request, _helpers.make_scheduler
run_to_completion, step = _helpers.run_to_completion, _helpers.step


def test_abort_between_schedule_and_update_drops_sampled_token() -> None:
    """The reproduction from the issue: this used to append the token and raise in list.remove."""
    sched = make_scheduler(num_blocks=16)
    req = make_request("a", 6, 5, arrival_time=0)
    sched.add_request(req)
    out = sched.schedule()
    runner_out = fake_runner(out)
    assert runner_out.sampled_token_ids == {"a": [TOKEN]}
    assert sched.abort_requests(["a"]) == [req]
    assert sched.kv.num_free_blocks == 16  # freed at once, not at the next step
    updated, finished = sched.update_from_output(out, runner_out)
    assert updated == [] and finished == []
    assert req.output_token_ids == [] and req.num_computed_tokens == 0
    assert req.status is RequestStatus.FINISHED_ABORTED
    check_pool(sched)
    assert not sched.has_unfinished_requests() and sched.schedule().finished_req_ids == {"a"}


def test_abort_one_of_a_batch_mid_step_keeps_the_others() -> None:
    sched = make_scheduler(num_blocks=32)
    reqs = [make_request(rid, 5, 3, arrival_time=i) for i, rid in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    step(sched)  # prefill + first token for all three
    out = sched.schedule()
    runner_out = fake_runner(out)
    sched.abort_requests(["b"])
    updated, _ = sched.update_from_output(out, runner_out)
    assert [r.request_id for r in updated] == ["a", "c"]
    check_pool(sched)
    run_to_completion(sched)
    assert reqs[0].output_token_ids == reqs[2].output_token_ids == [TOKEN] * 3
    assert reqs[1].output_token_ids == [TOKEN] and reqs[1].status is RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == 32


def test_abort_mid_chunked_prefill_and_between_steps() -> None:
    sched = make_scheduler(num_blocks=16, long_prefill_token_threshold=4)
    req = make_request("a", 10, 5, arrival_time=0)
    sched.add_request(req)
    step(sched)
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens and sched.kv.num_free_blocks < 16
    out = sched.schedule()  # second chunk scheduled, then aborted before its result lands
    sched.abort_requests(["a"])
    sched.update_from_output(out, fake_runner(out))
    assert req.num_computed_tokens == 4 and sched.kv.num_free_blocks == 16
    check_pool(sched)


def test_abort_waiting_and_preempted_requests() -> None:
    # 4 blocks of 4 tokens: two 6-token prompts fit, growth forces a preemption (recompute)
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    a, b = make_request("a", 6, 8, arrival_time=0), make_request("b", 6, 8, arrival_time=1)
    waiting = make_request("w", 6, 8, arrival_time=2)
    for r in (a, b, waiting):
        sched.add_request(r)
    preempted = None
    for _ in range(20):
        out = step(sched)
        if out.preempted_req_ids:
            preempted = sched.requests[next(iter(out.preempted_req_ids))]
            break
    assert preempted is not None and preempted.status is RequestStatus.PREEMPTED
    aborted = sched.abort_requests([preempted.request_id, "w"])
    assert {r.request_id for r in aborted} == {preempted.request_id, "w"}
    check_pool(sched)
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 4


def test_abort_after_finish_is_a_no_op_and_unknown_results_are_ignored() -> None:
    sched = make_scheduler(num_blocks=16)
    req = make_request("a", 4, 1, arrival_time=0)
    sched.add_request(req)
    out = sched.schedule()
    extra = ModelRunnerOutput(sampled_token_ids={"a": [TOKEN], "ghost": [TOKEN]})
    updated, finished = sched.update_from_output(out, extra)
    assert finished == [req] and req.finish_reason == "length"
    assert sched.abort_requests(["a", "ghost"]) == []
    assert req.status is RequestStatus.FINISHED_LENGTH
    # replaying the same step's output for a finished request changes nothing
    assert sched.update_from_output(out, extra) == ([], [])
    assert req.output_token_ids == [TOKEN]
    check_pool(sched)


@pytest.mark.parametrize("point", ["before_schedule", "after_schedule", "after_step"])
def test_engine_abort_returns_final_output(make_llm, point: str) -> None:
    engine = make_llm().engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("x", [1, 5, 6, 7], params)
    engine.add_request("keep", [1, 9, 10], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    if point == "before_schedule":
        outs = engine.abort_request("x")
        rest = engine.step()
    elif point == "after_schedule":  # abort lands while the step runs (between schedule and update)
        real_update = engine.scheduler.update_from_output
        outs = []

        def update(sched_out, runner_out):
            outs.extend(engine.abort_request("x"))
            return real_update(sched_out, runner_out)

        engine.scheduler.update_from_output = update
        rest = engine.step()
        engine.scheduler.update_from_output = real_update
    else:
        rest = engine.step()
        outs = engine.abort_request("x")
    assert not [o for o in rest if o.request_id == "x" and (o.finished or point != "after_step")]
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    n_out = len(outs[0].outputs[0].token_ids)
    assert n_out == (2 if point == "after_step" else 1)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"] and len(done[0].outputs[0].token_ids) == 4
    assert engine.abort_request("x") == []
