"""The replay test: a real run's step times fed to ``executor=sim`` (virtual clock, same arrival trace) reproduce
that run's scheduler decisions exactly: which requests run with how many tokens, preemptions, prefix hits per
step; every request's latencies agree to within the part of a step outside its forward.

Both runs are driven by one loop on the engine's own clock. It admits the requests that arrived by the time it
reads at the top of each iteration; an idle engine jumps (sleeps) to the next arrival, and that arrival time,
not the reading after waking, is the iteration's time in both runs. The replayed duration of a step is then
the real clock's advance from one iteration's time to the next reading, so the simulated clock reads at every
iteration what the real one read. (A policy that reads the clock while it schedules, ``sjf``'s aging, sees
the reading plus the microseconds of admission in the real run; its default 10 s aging is never crossed here.)
"""

from __future__ import annotations

import json
import random

import pytest
from helpers import STORIES

from framework import build_engine
from framework.config import EngineConfig
from framework.core.sampling_params import SamplingParams

pytestmark = pytest.mark.isolated  # latencies compared to a step's bookkeeping: alone under pytest-xdist

VOCAB = 512


def _trace(seed: int = 0) -> list[tuple[str, float, list[int], int]]:
    """``(id, arrival s, prompt ids, max_tokens)``: bursts and gaps, two shared 32-token prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(2)]
    t, trace = 0.0, []
    for i in range(14):
        t += rng.choice((0.0, 0.002, 0.004, 0.03))  # a 30 ms gap leaves the engine idle now and then
        prompt = (prefixes[i % 2] if i % 3 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 40))]
        trace.append((f"r{i}", t, prompt, rng.randint(6, 24)))
    return trace


def _drive(engine, trace, decisions: list, forwards: list | None = None) -> tuple[list[float], dict]:
    """Run ``trace`` to completion; returns each step's duration on the engine's clock and the final metrics.
    ``forwards``, when given, collects each step's ``execute_model`` seconds on the same clock (0 for a step
    that scheduled nothing)."""
    schedule = engine.scheduler.schedule
    if forwards is not None:
        execute_model = engine.executor.execute_model

        def timed_execute_model(*args, **kwargs):
            start = engine.clock.now()
            try:
                return execute_model(*args, **kwargs)
            finally:
                forwards[-1] += engine.clock.now() - start

        engine.executor.execute_model = timed_execute_model

    def recording_schedule():
        out = schedule()
        decisions.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids),
                          sorted((r.request_id, r.num_computed_tokens) for r in out.scheduled_requests)))
        return out

    engine.scheduler.schedule = recording_schedule
    clock, pending, durations, metrics = engine.clock, list(trace), [], {}
    t0 = clock.now()
    iteration_time = None
    while pending or engine.has_unfinished_requests():
        now = clock.now() - t0
        if iteration_time is not None:
            durations.append(now - iteration_time)
        if not engine.has_unfinished_requests() and pending[0][1] > now:
            clock.sleep_until(t0 + pending[0][1])
            now = pending[0][1]
        while pending and pending[0][1] <= now:
            rid, arrival, prompt, max_tokens = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               arrival_time=t0 + arrival)
        iteration_time = now
        if forwards is not None:
            forwards.append(0.0)
        metrics.update({o.request_id: o.metrics for o in engine.step() if o.finished})
    durations.append(clock.now() - t0 - iteration_time)
    return durations, metrics


@pytest.mark.parametrize("scheduler, kv_allocator", [("fcfs", "paged"), ("sjf", "radix")])
def test_replaying_a_real_runs_step_times_reproduces_its_decisions(scheduler, kv_allocator, tmp_path):
    knobs = dict(model=STORIES, compile=False, scheduler=scheduler, kv_allocator=kv_allocator, max_model_len=128,
                 num_blocks=12, max_num_batched_tokens=64,
                 attention_params={"compile": False})  # no start-up compile of the kernel: this test runs alone
    real = build_engine(EngineConfig(**knobs))
    real_decisions: list = []
    forwards: list = []
    try:
        durations, real_metrics = _drive(real, _trace(), real_decisions, forwards)
        real_hit_rate = real.scheduler.kv.stats().hit_rate
    finally:
        real.shutdown()
    assert len(forwards) == len(durations), "one forward per step"
    bookkeeping = max(d - f for d, f in zip(durations, forwards, strict=True))
    assert any(preempted for _, preempted, _ in real_decisions), "the trace must preempt (KV pressure)"
    assert real_hit_rate > 0, "the trace must hit the prefix cache"

    replay = tmp_path / "steps.json"
    replay.write_text(json.dumps(durations))
    sim = build_engine(EngineConfig(**knobs, executor="sim",
                                    executor_params={"clock": "virtual", "profile": f"replay:{replay}"}))
    sim_decisions: list = []
    try:
        _, sim_metrics = _drive(sim, _trace(), sim_decisions)
        assert sim.scheduler.kv.stats().hit_rate == real_hit_rate
        assert sim.metrics.summary()["sim_profile"] == "replay:steps.json"
    finally:
        sim.shutdown()
    assert sim_decisions == real_decisions
    assert set(sim_metrics) == set(real_metrics)
    for rid, m in real_metrics.items():
        s = sim_metrics[rid]
        assert (s.num_cached_tokens, s.num_preemptions, s.num_output_tokens) == (
            m.num_cached_tokens, m.num_preemptions, m.num_output_tokens)
        # the real clock stamps inside a step (after scheduling, after the forward), the replayed one at the
        # iteration's reading and at the step's end: latencies agree to within the real run's longest
        # bookkeeping (a step's time outside its forward: ~1 ms, more when the machine stalls the process)
        for name in ("queue_s", "ttft_s", "e2e_s", "tpot_s"):
            assert getattr(s, name) == pytest.approx(getattr(m, name), abs=bookkeeping + 1e-4), (rid, name)


def test_a_diverging_replay_names_the_cause(tmp_path):
    replay = tmp_path / "short.json"
    replay.write_text("[0.01]")
    engine = build_engine(EngineConfig(model=STORIES, compile=False, executor="sim",
                                       executor_params={"profile": f"replay:{replay}"}))
    try:
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        with pytest.raises(RuntimeError, match="other decisions than the recorded one"):
            engine.step()
    finally:
        engine.shutdown()
