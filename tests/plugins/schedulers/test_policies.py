"""sjf, lpm and fair policies, model-free: a simulated clock (one unit per engine step) replaces wall time."""

from __future__ import annotations

import random

import pytest

from framework import registry
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.testing.shadow_cache import fake_runner
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fair import FairPolicy
from plugins.schedulers.lpm import LPMPolicy
from plugins.schedulers.sjf import SJFPolicy


class Clock:
    """Injected time source: the simulation advances it by one unit per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scheduler(policy, num_blocks=256, block_size=4, max_num_seqs=2, max_num_batched_tokens=512) -> Scheduler:
    return Scheduler(policy, PagedKVAllocator(num_blocks, block_size), StopChecker(tokenizer=None),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=num_blocks * block_size)


def req(rid: str, n_prompt: int, max_tokens: int, arrival: float, client: str | None = None,
        tokens: list[int] | None = None) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 97)
    return Request(rid, tokens or list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, eos_token_ids=frozenset(), client_id=client)


def run(sched: Scheduler, arrivals: list[Request], clock: Clock, max_steps: int = 5000) -> dict[str, float]:
    """Step until done; requests join when ``clock >= arrival_time``. Returns first-token time per request."""
    pending = sorted(arrivals, key=lambda r: r.arrival_time)
    first: dict[str, float] = {}
    order: list[str] = []
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock.now:
            sched.add_request(pending.pop(0))
        out = sched.schedule()
        for r in out.scheduled_requests:
            if r.request_id not in order:
                order.append(r.request_id)
        runner_out = fake_runner(out, lambda r: 5)
        sched.update_from_output(out, runner_out)
        clock.now += 1.0
        for rid in runner_out.sampled_token_ids:
            first.setdefault(rid, clock.now)
        assert clock.now < max_steps
    run.admission_order = order
    return first


def poisson_mixed(seed: int, n: int = 40, rate: float = 0.5) -> list[Request]:
    """Poisson arrivals (rate per step) with a bimodal output length: mostly short, some long."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        long = rng.random() < 0.3
        out.append(req(f"q{i}", rng.randint(4, 12), rng.randint(40, 60) if long else rng.randint(2, 6), t))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sjf_lowers_mean_ttft_vs_fcfs_on_a_mixed_poisson_workload(seed):
    ttft = {}
    for name in ("fcfs", "sjf"):
        clock = Clock()
        policy = SJFPolicy(aging_s=1e9, clock=clock) if name == "sjf" else registry.create("scheduler", "fcfs")
        reqs = poisson_mixed(seed)
        first = run(scheduler(policy), reqs, clock)
        ttft[name] = sum(first[r.request_id] - r.arrival_time for r in reqs) / len(reqs)
    assert ttft["sjf"] < ttft["fcfs"], ttft


def test_sjf_aging_bounds_the_wait_of_a_long_request():
    """A long request in a steady stream of short ones: without aging it starves; with aging_s=A it is
    admitted at most A + (the longest residual service of one batch slot) after arrival."""
    aging_s = 15.0
    for aging, must_wait_less in ((1e9, False), (aging_s, True)):
        clock = Clock()
        long = req("long", 8, 30, arrival=0.5)
        shorts = [req(f"s{i}", 4, 3, arrival=float(i) / 2) for i in range(200)]
        first = run(scheduler(SJFPolicy(aging_s=aging, clock=clock), max_num_seqs=1), [long, *shorts], clock)
        wait = first["long"] - long.arrival_time
        if must_wait_less:
            assert wait <= aging_s + 4 + 1, wait  # a short job's service is <= 4 steps, +1 for the prefill step
        else:
            assert wait > 90, wait  # starved behind the stream


def test_sjf_rejects_bad_aging():
    with pytest.raises(ValueError, match="aging_s"):
        SJFPolicy(aging_s=0)


def test_lpm_admits_the_longest_cached_prefix_first():
    clock = Clock()
    sched = scheduler(LPMPolicy(), max_num_seqs=1)
    shared = list(range(500, 540))
    run(sched, [req("warm", 0, 1, 0.0, tokens=shared + [1])], clock)  # caches 40 tokens of prefix
    a = req("a_no_hit", 0, 1, 10.0, tokens=list(range(800, 844)))
    b = req("b_short_hit", 0, 1, 10.0, tokens=shared[:8] + list(range(900, 936)))
    c = req("c_long_hit", 0, 1, 10.0, tokens=shared + [7, 8, 9, 10])
    run(sched, [a, b, c], clock)
    assert run.admission_order == ["c_long_hit", "b_short_hit", "a_no_hit"]


def test_fair_interleaves_clients_round_robin():
    clock = Clock()
    flood = [req(f"A{i}", 4, 2, arrival=0.0, client="A") for i in range(6)]
    others = [req("B0", 4, 2, arrival=0.1, client="B"), req("C0", 4, 2, arrival=0.2, client="C"),
              req("B1", 4, 2, arrival=0.3, client="B")]
    run(scheduler(FairPolicy(), max_num_seqs=1), flood + others, clock)
    order = run.admission_order
    assert order[:5] == ["A0", "B0", "C0", "A1", "B1"], order


def test_fair_victim_comes_from_the_heaviest_client():
    policy = FairPolicy()
    running = [req("A0", 4, 2, 0.0, "A"), req("B0", 4, 2, 1.0, "B"), req("A1", 4, 2, 0.5, "A")]
    assert policy.select_victim(running).request_id == "A1"


def test_scheduler_hands_its_clock_to_the_policy_through_use_clock():
    """A scheduler built with a clock (an engine's: wall or simulated) gives the policy its ``now`` via
    ``use_clock``, so sjf ages requests on that clock, not on wall time."""
    from framework.core.clock import VirtualClock

    clock = VirtualClock()
    policy = SJFPolicy(aging_s=10.0)
    Scheduler(policy, PagedKVAllocator(16, 4), StopChecker(tokenizer=None), max_num_seqs=1,
              max_num_batched_tokens=64, max_model_len=64, clock=clock)
    old = req("old", 8, 30, arrival=0.0)
    young = req("young", 4, 3, arrival=0.0)
    assert policy.key(young) < policy.key(old)  # shorter first while neither has aged
    clock.sleep_until(11.0)  # virtual: jumps at once
    assert policy.clock() == 11.0 and policy.key(old) <= policy.key(young)  # both aged: arrival order


def test_use_clock_hands_sjf_the_engines_time_source():
    """``SchedulerPolicy.use_clock``: a simulated clock decides aging, not the wall clock."""
    policy = registry.create("scheduler", "sjf", aging_s=5.0)
    now = [0.0]
    policy.use_clock(lambda: now[0])
    short = Request(request_id="short", prompt_token_ids=[1, 2], sampling_params=SamplingParams(max_tokens=1),
                    arrival_time=4.0)
    long = Request(request_id="long", prompt_token_ids=list(range(3, 40)), sampling_params=SamplingParams(max_tokens=9),
                   arrival_time=0.0)
    now[0] = 4.5  # nothing aged yet: shortest first
    assert [r.request_id for r in policy.sort_waiting([long, short])] == ["short", "long"]
    now[0] = 5.0  # "long" waited aging_s on the engine's clock
    assert [r.request_id for r in policy.sort_waiting([long, short])] == ["long", "short"]
