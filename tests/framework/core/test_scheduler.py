"""Tests of ``framework.core.scheduler``: token budget, chunked prefill, preemption, priority, prefix hits, aborts.

Model-free: the real ``PagedKVAllocator`` and the real ``fcfs``/``priority`` policies, with a fake runner
that samples token ``TOKEN`` for every scheduled request whose step reaches the end of its tokens.
Requests finish by length (no EOS ids).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy
from plugins.schedulers.priority import PriorityPolicy

TOKEN = 7  # what the fake runner samples
POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_scheduler(policy: str = "fcfs", *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int | None = None,
                   long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True) -> Scheduler:
    """A scheduler over a fresh paged pool; ``max_model_len`` defaults to the pool's capacity."""
    kv = PagedKVAllocator(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(POLICIES[policy](), kv, StopChecker(tokenizer=None), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len or num_blocks * block_size,
                     long_prefill_token_threshold=long_prefill_token_threshold)


def make_request(request_id: str, prompt: int | list[int], max_tokens: int, arrival_time: float,
                 priority: int = 0) -> Request:
    """``prompt`` is a token list or a length (then distinct tokens starting at a per-id offset)."""
    start = 1000 * sum(map(ord, request_id))  # different ids share no prefix block
    tokens = prompt if isinstance(prompt, list) else list(range(start, start + prompt))
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens), priority=priority,
                   arrival_time=arrival_time, eos_token_ids=frozenset())


def fake_runner(out: SchedulerOutput) -> ModelRunnerOutput:
    """Sample ``TOKEN`` for each request whose scheduled tokens reach the end of its tokens."""
    return ModelRunnerOutput(sampled_token_ids={
        r.request_id: [TOKEN] for r in out.scheduled_requests
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens})


def check_schedule(sched: Scheduler, out: SchedulerOutput, running_before: list[Request]) -> None:
    """Budget, sequence cap, per-request token bounds, exact block coverage, running-first rule."""
    n = out.num_scheduled_tokens
    ids = [r.request_id for r in out.scheduled_requests]
    assert len(set(ids)) == len(ids) and set(ids) == set(n)
    assert out.total_num_scheduled_tokens == sum(n.values()) <= sched.max_num_batched_tokens
    assert len(out.scheduled_requests) <= len(sched.running) <= sched.max_num_seqs
    bs = sched.kv.block_size
    for r in out.scheduled_requests:
        k = n[r.request_id]
        assert r.status is RequestStatus.RUNNING and r in sched.running
        assert 1 <= k <= r.num_tokens - r.num_computed_tokens, (r.request_id, k)
        if sched.long_prefill_token_threshold:
            assert k <= sched.long_prefill_token_threshold
        assert len(out.block_ids[r.request_id][0]) == -(-(r.num_computed_tokens + k) // bs)
    admitted = [rid for rid in ids if rid not in {r.request_id for r in running_before}]
    starved = [r.request_id for r in running_before if r.request_id not in n and r.request_id not in
               out.preempted_req_ids]
    assert not (admitted and starved), f"admitted {admitted} while running {starved} got no tokens"


def check_pool(sched: Scheduler) -> None:
    """Allocator invariants; waiting requests own nothing; shared blocks are identical full prefixes."""
    kv, bs = sched.kv, sched.kv.block_size
    kv.check_invariants()
    waiting = list(sched.waiting)
    assert {r.request_id for r in waiting + sched.running} == set(sched.requests)
    assert len(sched.running) <= sched.max_num_seqs
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0 and kv.get_block_ids(r.request_id) == []
    owners: dict[int, list[tuple[Request, int]]] = {}
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        table = kv.get_block_ids(r.request_id)
        assert len(table) == -(-r.num_computed_tokens // bs)
        for pos, block in enumerate(table):
            owners.setdefault(block, []).append((r, pos))
    for block, held in owners.items():
        r0, pos0 = held[0]
        for r, pos in held[1:]:  # only prefix caching may share a block: same place, same full prefix
            end = (pos0 + 1) * bs
            assert pos == pos0 and min(r.num_computed_tokens, r0.num_computed_tokens) >= end, block
            assert r.all_token_ids[:end] == r0.all_token_ids[:end], block


def step(sched: Scheduler) -> SchedulerOutput:
    """One checked engine step with the fake runner."""
    running_before = list(sched.running)
    out = sched.schedule()
    check_schedule(sched, out, running_before)
    sched.update_from_output(out, fake_runner(out))
    check_pool(sched)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    """Checked steps until nothing is left; fails if that takes ``max_steps``."""
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    """request_id -> tokens scheduled this step."""
    return dict(out.num_scheduled_tokens)


# ---- budget and order ------------------------------------------------------------------------
def test_budget_and_max_num_seqs_cap_each_step() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=32)
    reqs = [make_request(f"r{i}", 30, 4, arrival_time=i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    assert scheduled(step(sched)) == {"r0": 30, "r1": 2}
    assert scheduled(step(sched)) == {"r0": 1, "r1": 28, "r2": 3}
    assert scheduled(step(sched)) == {"r0": 1, "r1": 1, "r2": 27}  # r3 waits: max_num_seqs
    outs = run_to_completion(sched)
    assert all(r.output_token_ids == [TOKEN] * 4 for r in reqs)
    assert not any(o.preempted_req_ids for o in outs)


def test_long_prefill_token_threshold_caps_chunks() -> None:
    sched = make_scheduler(long_prefill_token_threshold=8)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 20, 2, arrival_time=i))
    assert [scheduled(step(sched)) for _ in range(4)] == [
        {"r0": 8, "r1": 8}, {"r0": 8, "r1": 8}, {"r0": 4, "r1": 4}, {"r0": 1, "r1": 1}]


def test_chunked_prefill_samples_only_at_the_end() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    r = make_request("r", 50, 3, arrival_time=0)
    sched.add_request(r)
    progress = []
    for _ in range(6):
        out = step(sched)
        progress.append((out.num_scheduled_tokens["r"], r.num_computed_tokens, r.num_output_tokens))
    assert progress == [(16, 16, 0), (16, 32, 0), (16, 48, 0), (2, 50, 1), (1, 51, 2), (1, 52, 3)]
    assert r.status is RequestStatus.FINISHED_LENGTH and not sched.has_unfinished_requests()


def test_running_decode_is_not_starved_by_a_long_waiting_prompt() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    decoder = make_request("decoder", 4, 20, arrival_time=0)
    sched.add_request(decoder)
    step(sched)
    sched.add_request(make_request("long", 100, 1, arrival_time=1))
    for chunk in [15] * 6 + [10]:  # 100 prompt tokens in chunks of what the decode leaves
        assert scheduled(step(sched)) == {"decoder": 1, "long": chunk}
    assert sched.kv.get_block_ids("long") == [] and decoder.num_output_tokens == 8


# ---- preemption ------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_by_recompute_evicts_latest_arrival(policy: str) -> None:
    # 6 blocks of 4 tokens; each request ends at 7 + 10 = 17 tokens (5 blocks)
    sched = make_scheduler(policy, num_blocks=6, block_size=4, enable_prefix_caching=False)
    a, b, c = (make_request(n, 7, 10, arrival_time=t) for n, t in [("a", 1.0), ("b", 2.0), ("c", 3.0)])
    sched.add_request(a)
    sched.add_request(c)
    step(sched)
    sched.add_request(b)  # admitted after c but arrived before it
    assert scheduled(step(sched)) == {"a": 1, "c": 1, "b": 7}
    assert [r.request_id for r in sched.running] == ["a", "c", "b"] and sched.kv.num_free_blocks == 0
    out = step(sched)  # a needs a 3rd block: the latest arrival (c) is the victim, not the last admitted (b)
    assert out.preempted_req_ids == {"c"} and scheduled(out) == {"a": 1, "b": 1}
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == [TOKEN, TOKEN] and sched.kv.get_block_ids("c") == []
    assert sched.num_preemptions_last_step == 1
    readmitted = []
    for out in run_to_completion(sched):
        if "c" in out.num_scheduled_tokens and not readmitted:
            readmitted.append(out.num_scheduled_tokens["c"])
    assert readmitted == [9]  # prompt + both kept outputs recomputed in one step
    assert [r.output_token_ids for r in (a, b, c)] == [[TOKEN] * 10] * 3
    assert a.num_preemptions == 0 and sched.kv.num_free_blocks == 6


# ---- priority --------------------------------------------------------------------------------
def admission_order(sched: Scheduler) -> list[str]:
    """Request ids in the order they were first scheduled, running to completion."""
    order: list[str] = []
    for out in run_to_completion(sched):
        order += [rid for rid in out.num_scheduled_tokens if rid not in order]
    return order


@pytest.mark.parametrize("policy, expected", [("priority", ["b", "d", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])])
def test_priority_lower_value_first_ties_by_arrival(policy: str, expected: list[str]) -> None:
    sched = make_scheduler(policy, max_num_seqs=1)
    for rid, prio, t in [("d", 0, 4.0), ("c", 1, 3.0), ("b", 0, 2.0), ("a", 2, 1.0)]:
        sched.add_request(make_request(rid, 5, 2, arrival_time=t, priority=prio))
    assert admission_order(sched) == expected


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_arrival_preempts_when_seqs_are_full(policy: str) -> None:
    sched = make_scheduler(policy, max_num_seqs=2)
    low = [make_request(f"low{i}", 5, 6, arrival_time=i, priority=5) for i in range(2)]
    for r in low:
        sched.add_request(r)
    step(sched)
    high = make_request("high", 5, 2, arrival_time=-1, priority=0)  # outranks under both policies
    sched.add_request(high)
    out = step(sched)
    if policy == "priority":
        assert out.preempted_req_ids == {"low1"} and scheduled(out) == {"low0": 1, "high": 5}
        assert low[1].status is RequestStatus.PREEMPTED and low[1].num_preemptions == 1
    else:
        assert not out.preempted_req_ids and scheduled(out) == {"low0": 1, "low1": 1}
    run_to_completion(sched)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in [*low, high])
    assert low[0].num_preemptions == 0 and (low[1].num_preemptions == 1) == (policy == "priority")


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_high_priority_arrival_preempts_when_kv_is_short(policy: str) -> None:
    # 4 blocks of 4: two 5-token prompts own all of them; each has room until 8 tokens
    sched = make_scheduler(policy, num_blocks=4, block_size=4, max_num_seqs=8)
    low = [make_request(f"low{i}", 5, 4, arrival_time=i, priority=5) for i in range(2)]
    for r in low:
        sched.add_request(r)
    step(sched)
    assert sched.kv.num_free_blocks == 0
    sched.add_request(make_request("high", 4, 2, arrival_time=-1, priority=0))  # outranks under both
    out = step(sched)
    if policy == "priority":
        assert out.preempted_req_ids == {"low1"} and scheduled(out) == {"low0": 1, "high": 4}
    else:
        assert not out.preempted_req_ids and scheduled(out) == {"low0": 1, "low1": 1}
        assert not step(sched).preempted_req_ids  # still no room for high, still no preemption
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 4


def test_prefix_hit_held_by_a_running_request_needs_no_preemption() -> None:
    # 8 blocks of 4: "p" owns 4 full prompt blocks, "low" 2 blocks; "high" shares p's 16-token prefix
    sched = make_scheduler("priority", num_blocks=8, block_size=4)
    prompt = list(range(16))
    sched.add_request(make_request("p", prompt, 8, arrival_time=0))
    low = make_request("low", 5, 8, arrival_time=1, priority=5)
    sched.add_request(low)
    step(sched)
    assert sched.kv.num_free_blocks == 2
    high = make_request("high", [*prompt, 99], 2, arrival_time=2)
    sched.add_request(high)
    out = step(sched)  # p's decode takes one free block, high's one new token the other
    assert not out.preempted_req_ids and scheduled(out) == {"p": 1, "low": 1, "high": 1}
    assert high.num_cached_tokens == 16 and low.num_preemptions == 0


# ---- prefix caching and aborts ---------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_prefix_hit_through_the_scheduler(caching: bool) -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=caching)
    prompt = list(range(20))
    first = make_request("first", prompt, 8, arrival_time=0)
    sched.add_request(first)
    step(sched)
    second = make_request("second", list(prompt), 8, arrival_time=1)
    sched.add_request(second)
    out = step(sched)
    hit = 16 if caching else 0  # whole blocks only, and one prompt token is always recomputed
    assert second.num_cached_tokens == hit and out.num_scheduled_tokens["second"] == 20 - hit
    shared = set(sched.kv.get_block_ids("first")) & set(sched.kv.get_block_ids("second"))
    assert len(shared) == hit // 4
    run_to_completion(sched)
    assert second.output_token_ids == first.output_token_ids == [TOKEN] * 8


def test_abort_frees_running_and_waiting_requests() -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    running, waiting = make_request("run", 9, 5, arrival_time=0), make_request("wait", 9, 5, arrival_time=1)
    sched.add_request(running)
    sched.add_request(waiting)
    step(sched)
    assert sched.kv.num_free_blocks == 13 and sched.num_waiting == 1
    aborted = sched.abort_requests(["run", "wait", "unknown"])
    assert aborted == [running, waiting] and sched.abort_requests(["run"]) == []
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in aborted)
    assert sched.kv.num_free_blocks == 16 and not sched.has_unfinished_requests()
    check_pool(sched)
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"run", "wait"}
    assert sched.schedule().finished_req_ids == set()


def test_finished_ids_reported_once_in_the_next_output() -> None:
    sched = make_scheduler()
    r = make_request("r", 3, 1, arrival_time=0)
    sched.add_request(r)
    out = step(sched)
    assert r.status is RequestStatus.FINISHED_LENGTH and out.finished_req_ids == set()
    assert sched.schedule().finished_req_ids == {"r"}
    assert sched.schedule().finished_req_ids == set()


# ---- property test ---------------------------------------------------------------------------
MAX_PROMPT, MAX_OUTPUT = 60, 20


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.integers(1, 8))
    max_model_len = draw(st.integers(MAX_PROMPT + MAX_OUTPUT, 100))
    min_blocks = -(-max_model_len // block_size)
    base = draw(st.lists(st.integers(0, 3), min_size=MAX_PROMPT, max_size=MAX_PROMPT))  # shared prefixes
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = base[:draw(st.integers(0, MAX_PROMPT))]
        tail = draw(st.lists(st.integers(0, 3), min_size=0 if prefix else 1, max_size=MAX_PROMPT - len(prefix)))
        requests.append((prefix + tail, draw(st.integers(1, MAX_OUTPUT)), draw(st.integers(0, 3)),
                         draw(st.integers(0, 20)), draw(st.integers(0, 20))))
        # prompt, max_tokens, priority, step it is added at, arrival_time (may disagree with that step)
    return dict(
        block_size=block_size, max_model_len=max_model_len,
        num_blocks=draw(st.integers(min_blocks, 3 * min_blocks)),
        max_num_seqs=draw(st.integers(1, 8)), max_num_batched_tokens=draw(st.integers(1, 64)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 1, 5, 16])),
        enable_prefix_caching=draw(st.booleans()), requests=requests,
        aborts=draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, len(requests) - 1)), max_size=3)),
    )


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@settings(max_examples=60, deadline=None)
@given(w=workloads())
def test_random_workloads_run_to_completion(policy: str, w: dict) -> None:
    sched = make_scheduler(policy, **{k: v for k, v in w.items() if k not in ("requests", "aborts")})
    arrivals = sorted(range(len(w["requests"])), key=lambda i: w["requests"][i][3])
    reqs = {}
    for i in arrivals:
        prompt, max_tokens, priority, _, arrival_time = w["requests"][i]
        reqs[i] = make_request(f"r{i}", prompt, max_tokens, arrival_time=float(arrival_time), priority=priority)
    aborted: set[str] = set()
    finished_ids: list[str] = []
    num_preempted = dict.fromkeys((r.request_id for r in reqs.values()), 0)
    step_no = 0
    while step_no <= 20 or sched.has_unfinished_requests():
        for i in arrivals:
            if w["requests"][i][3] == step_no:
                sched.add_request(reqs[i])
        for at, i in w["aborts"]:
            if at == step_no:
                aborted |= {r.request_id for r in sched.abort_requests([f"r{i}"])}
        check_pool(sched)
        outputs_before = {r.request_id: list(r.output_token_ids) for r in reqs.values()}
        running_before = {r.request_id for r in sched.running}
        out = step(sched)
        for r in reqs.values():  # outputs only grow, one token a step, even across preemption
            assert r.output_token_ids[:len(outputs_before[r.request_id])] == outputs_before[r.request_id]
            assert r.num_output_tokens - len(outputs_before[r.request_id]) <= 1
        for rid in out.preempted_req_ids:
            num_preempted[rid] += 1
        if policy == "fcfs" and out.preempted_req_ids:  # only KV growth of running requests preempts
            assert set(out.num_scheduled_tokens) <= running_before
        finished_ids += out.finished_req_ids
        step_no += 1
        assert step_no < 3000, "scheduler made no progress"
    finished_ids += sched.schedule().finished_req_ids
    assert sorted(finished_ids) == sorted(r.request_id for r in reqs.values())  # each reported once
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    sched.kv.check_invariants()
    for r in reqs.values():
        assert r.num_preemptions == num_preempted[r.request_id]
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert r.num_output_tokens <= r.sampling_params.max_tokens
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == [TOKEN] * r.sampling_params.max_tokens
