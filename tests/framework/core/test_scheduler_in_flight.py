"""The scheduler under a batch queue (vLLM's ``scheduled_req_ids``): a request with a step in flight is not
scheduled again, not preempted, and does not count against the next batch's ``max_num_seqs``; an abort while
in flight drops its output and its id waits for the batch to come back."""

from __future__ import annotations

from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy
from plugins.schedulers.priority import PriorityPolicy

TOKEN = 7


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 2, budget: int = 64) -> Scheduler:
    kv = PagedKVAllocator(num_blocks, 4, True)
    return Scheduler(FCFSPolicy(), kv, StopChecker(tokenizer=None), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, max_model_len=num_blocks * 4)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0,
                 arrival_time: float = 0.0) -> Request:
    start = 1000 * sum(map(ord, request_id))
    return Request(request_id, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   priority=priority, arrival_time=arrival_time, eos_token_ids=frozenset())


def sampled(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled_token_ids={
        r.request_id: [TOKEN] for r in out.scheduled_requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens})


def test_in_flight_requests_are_skipped_and_max_num_seqs_caps_one_batch():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abcd":
        sched.add_request(make_request(rid, 5))
    first = sched.schedule()
    second = sched.schedule()  # the first batch's output has not come back
    assert set(first.num_scheduled_tokens) == {"a", "b"} and set(second.num_scheduled_tokens) == {"c", "d"}
    assert sched.in_flight == {"a", "b", "c", "d"}
    assert sched.schedule().is_empty  # everything is in flight: nothing to run
    sched.update_from_output(first, sampled(first))
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"a": 1, "b": 1}  # their decode, after the prompt's 5 tokens
    assert [r.output_token_ids for r in third.scheduled_requests] == [[TOKEN], [TOKEN]]


def test_a_request_in_flight_is_never_preempted():
    # 4 blocks of 4: two 5-token prompts own all of them; "high" outranks them (the priority policy would preempt)
    kv = PagedKVAllocator(4, 4, True)
    sched = Scheduler(PriorityPolicy(), kv, StopChecker(tokenizer=None), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=16)
    for i in range(2):
        sched.add_request(make_request(f"low{i}", 5, priority=5, arrival_time=i))
    first = sched.schedule()
    assert kv.num_free_blocks == 0 and sched.in_flight == {"low0", "low1"}
    sched.add_request(make_request("high", 4, priority=0, arrival_time=-1))
    second = sched.schedule()  # both low requests are in flight: their blocks are being written
    assert second.is_empty and not second.preempted_req_ids
    assert all(sched.requests[f"low{i}"].status is RequestStatus.RUNNING for i in range(2))
    sched.update_from_output(first, sampled(first))
    third = sched.schedule()  # back from the ranks: now the policy may evict one
    assert third.preempted_req_ids == {"low1"} and third.num_scheduled_tokens == {"low0": 1, "high": 4}


def test_abort_in_flight_drops_its_output_and_the_reused_id_waits():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    first = sched.schedule()
    (aborted,) = sched.abort_requests(["a"])
    assert aborted.status is RequestStatus.FINISHED_ABORTED and sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.add_request(make_request("a", 3))
    assert sched.schedule().num_scheduled_tokens == {}  # the old batch still runs under that id
    updated, _ = sched.update_from_output(first, sampled(first))
    assert updated == [] and not sched.in_flight
    assert sched.schedule().num_scheduled_tokens == {"a": 3}


def test_a_request_may_preempt_itself_in_a_batch_that_schedules_nothing():
    """With the others in flight, the only preemptible request is the one that needs a block: the batch then
    schedules nothing but carries its preemption (the engine sends it, so the workers re-table the request)."""
    sched = make_scheduler(num_blocks=3, max_num_seqs=1, budget=16)  # 3 blocks of 4 tokens
    sched.add_request(make_request("a", 4, max_tokens=8))
    sched.add_request(make_request("b", 4, max_tokens=8))
    first = sched.schedule()  # a: 4 tokens, 1 block
    second = sched.schedule()  # b, admitted: a is in flight and max_num_seqs caps one batch
    assert set(first.num_scheduled_tokens) == {"a"} and set(second.num_scheduled_tokens) == {"b"}
    sched.update_from_output(first, sampled(first))
    sched.add_request(make_request("c", 4))
    third = sched.schedule()  # a decodes into a second block; c waits (max_num_seqs)
    assert third.num_scheduled_tokens == {"a": 1}
    sched.update_from_output(second, sampled(second))
    fourth = sched.schedule()  # b needs a block, none is free, a is in flight: b preempts itself
    assert fourth.is_empty and fourth.preempted_req_ids == {"b"}


def test_a_request_whose_victim_is_in_flight_waits_instead_of_preempting_itself():
    """FCFS's victim for "a" (first come) is "b", whose step is in flight: "a" waits a step (neither is preempted)
    and "b" goes once its batch is back. Preempting "a" itself instead (the higher-ranked request) made requests
    preempt each other in turn with two batches in flight and none finish (the shadow-cache livelock)."""
    sched = make_scheduler(num_blocks=2, max_num_seqs=1, budget=16)  # 2 blocks of 4 tokens
    sched.add_request(make_request("a", 4, max_tokens=8))
    sched.add_request(make_request("b", 4, max_tokens=8, arrival_time=1.0))
    first, second = sched.schedule(), sched.schedule()  # a, then b: each one block, none free
    assert set(first.num_scheduled_tokens) == {"a"} and set(second.num_scheduled_tokens) == {"b"}
    sched.update_from_output(first, sampled(first))
    third = sched.schedule()  # a needs a second block; its victim b is in flight
    assert third.is_empty and not third.preempted_req_ids
    assert sched.requests["a"].status is RequestStatus.RUNNING and sched.requests["a"].num_computed_tokens == 4
    sched.update_from_output(third, sampled(third))
    sched.update_from_output(second, sampled(second))
    fourth = sched.schedule()  # b is back: the policy's victim goes, a decodes
    assert fourth.preempted_req_ids == {"b"} and fourth.num_scheduled_tokens == {"a": 1}
