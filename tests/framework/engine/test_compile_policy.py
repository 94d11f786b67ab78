"""``engine.compile=auto|true|false``: the rule (no model), and how the engine applies it (stories260K, the
compile itself faked: ``tests/framework/worker/test_compile.py`` compiles for real the same way)."""

from __future__ import annotations

import logging

import pytest
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS

from framework import EngineConfig, SamplingParams
from framework.engine import compile_policy
from framework.engine.compile_calibration import CompilePlanner
from framework.engine.compile_policy import CompileCosts, decide_compile
from framework.worker.compile import CompileStats

REAL_DECIDE = CompilePlanner.decide  # captured at import, before conftest's session patch keeps auto eager


def _costs(warm_up_s=10.0, eager=None, compiled=None):
    return CompileCosts(warm_up_s, "test", eager or {1: 30.0, 64: 180.0}, compiled or {}, "test")


def test_rule():
    assert decide_compile("true", 0).compile and not decide_compile("false", 10**9).compile
    server = decide_compile("auto", None)
    assert server.compile and "server" in server.reason
    # batch 64: eager 180 ms, compiled 0.75 x 180 = 135 ms (prior ratio): 45 ms saved per step of 64 tokens
    below = decide_compile("auto", 6400, planned_requests=64, costs=_costs(), generated_tokens=0)
    assert not below.compile and "~4.5 s saved on 6,400 output tokens" in below.reason
    assert "engine.compile=true forces it" in below.reason and below.estimate["batch"] == 64
    at = decide_compile("auto", 6400, planned_requests=100, costs=_costs(), max_num_seqs=64, generated_tokens=9600)
    assert at.compile and "~11.2 s saved on 16,000 output tokens" in at.reason and "engine.compile=false" in at.reason
    assert at.estimate["warm_up_s"] == 10.0 and at.estimate["eager_step_ms"] == 180.0
    # batch 1: 15 ms saved per token, so 700 tokens pay for a 10 s warm-up
    assert decide_compile("auto", 700, costs=_costs()).compile and not decide_compile("auto", 600, costs=_costs()).compile
    none = decide_compile("auto", 10**9, costs=None)
    assert not none.compile and "no decode step time measured" in none.reason


def test_step_times_interpolate_and_use_measured_compiled_steps():
    costs = _costs(compiled={1: 10.0, 64: 100.0})
    assert costs.step_ms(1, compiled=False) == 30.0 and costs.step_ms(64, compiled=True) == 100.0
    assert costs.step_ms(32, compiled=False) == pytest.approx(30 + 150 * 31 / 63)
    assert costs.step_ms(128, compiled=True) == pytest.approx(10 + 90 * 127 / 63)  # extrapolated
    assert _costs().step_ms(1, compiled=True) == 15.0  # prior ratio 0.5 at batch 1


class FakeExecutor:
    """``collective_rpc`` for the planner: ``time_decode_steps`` answers fixed times."""

    def __init__(self, times):
        self.times, self.calls = times, 0

    def collective_rpc(self, method, args=(), unique_reply_rank=None):
        assert method == "time_decode_steps" and list(args[0]) == [1, 64]
        self.calls += 1
        return [dict(self.times)]


def test_planner_measures_once_and_keeps_the_warm_up(tmp_path, monkeypatch):
    from framework.engine import compile_calibration

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    monkeypatch.setattr(compile_calibration, "_inductor_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(compile_calibration.CompilePlanner, "decide", REAL_DECIDE)
    executor = FakeExecutor({1: 30.0, 64: 180.0})
    planner = CompilePlanner(EngineConfig(model=STORIES), executor)
    assert not planner.decide(100, 1, 0, lambda: False).compile and executor.calls == 0  # busy: nothing measured
    decision = planner.decide(100, 1, 0, lambda: True)
    assert executor.calls == 1 and "prior, cold" in decision.reason and not decision.compile
    assert planner.decide(100, 1, 0, lambda: True) and executor.calls == 1  # measured once per machine and model
    # a cold compile measured here, then one from inductor's cache
    executor.times = {1: 12.0, 64: 120.0}
    planner.record_compile(CompileStats(enabled=True, active=True, compile_s=30.0, num_cache_misses=3))
    costs = planner.costs(planner.load())
    assert costs.compiled_step_ms == {1: 12.0, 64: 120.0} and costs.warm_up_source.startswith("cached estimate")
    planner.record_compile(CompileStats(enabled=True, active=True, compile_s=4.0, num_cache_misses=0))
    costs = planner.costs(planner.load())
    assert costs.warm_up_s == 4.0 and costs.warm_up_source == "measured here, from inductor's cache"
    assert planner.decide(300, 1, 0, lambda: True).compile  # 300 tokens x 18 ms = 5.4 s > 4 s
    monkeypatch.setattr(compile_calibration, "_inductor_cache_dir", lambda: str(tmp_path / "gone"))
    assert planner.costs(planner.load()).warm_up_s == 30.0  # the cache it was measured with is gone: cold
    other = CompilePlanner(EngineConfig(model=STORIES, dtype="bfloat16"), executor)
    assert other.path != planner.path and other.load() == {}


@pytest.mark.parametrize(("value", "mode"), [(True, "true"), (False, "false"), ("auto", "auto"), ("false", "false")])
def test_config_normalizes_the_mode(value, mode):
    assert EngineConfig(model="m", compile=value).compile == mode


def test_config_refuses_other_modes():
    with pytest.raises(ValueError, match="compile must be auto, true or false"):
        EngineConfig(model="m", compile="sometimes")


@pytest.fixture
def fake_compiles(monkeypatch):
    """Record ``ModelRunner.compile_decoder`` calls instead of compiling."""
    from framework.worker.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(ModelRunner, "compile_decoder", lambda runner: calls.append(runner))
    return calls


@pytest.fixture
def real_planner(monkeypatch, tmp_path):
    """The real ``CompilePlanner.decide`` (conftest keeps auto eager), a calibration folder of its own,
    and decode steps "measured" at 30 ms (batch 1) and 180 ms (batch 64), compiled steps half and
    three quarters of that, and a 1 s warm-up."""
    from framework.engine import compile_calibration
    from framework.worker.model_runner import ModelRunner

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    monkeypatch.setattr(compile_calibration.CompilePlanner, "decide", REAL_DECIDE)
    monkeypatch.setattr(compile_policy, "PRIOR_WARM_UP_S", {"cold": 1.0, "cached": 1.0})
    monkeypatch.setattr(ModelRunner, "time_decode_steps", lambda runner, sizes: {1: 30.0, 64: 180.0})


def test_auto_compiles_before_the_call_that_pays(make_llm, real_planner, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm = make_llm()
    assert "engine.compile=auto: eager for now" in caplog.text
    cached_at_compile = []  # was any prefix still cached when the (faked) compile ran?
    monkeypatch.setattr(type(llm.engine.runner), "compile_decoder",
                        lambda runner: cached_at_compile.append(bool(llm.engine.kv_allocator._cached)))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm.generate(PREFIX_PROMPTS[:2], params)  # 16 tokens at batch 2: ~0.1 s saved < 1 s
    assert not cached_at_compile and "eager, ~1.0 s warm-up (prior, cold)" in caplog.text
    assert llm.engine.kv_allocator._cached  # the first call's prefixes are cached
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm.generate(STORY_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60))  # 76 tokens at batch 1
    assert cached_at_compile == [False]  # compiled once, after the prefix cache was dropped
    summary = llm.engine.metrics.summary()
    assert summary["compile_mode"] == "auto" and "compiling, ~1.0 s warm-up" in summary["compile_reason"]
    assert summary["compile_estimate"]["output_tokens"] == 76 and summary["compile_estimate"]["batch"] == 1


def test_auto_puts_the_compile_off_while_requests_hold_blocks(make_llm, fake_compiles, real_planner):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("busy", STORY_PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()  # the request now owns KV blocks
    decision = engine.maybe_compile(1000)
    assert not decision.compile and "no decode step time measured" in decision.reason and not fake_compiles
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.maybe_compile(1000).compile and len(fake_compiles) == 1


def test_forced_modes_ignore_the_work(make_llm, fake_compiles):
    llm = make_llm(compile=False)
    assert not llm.engine.maybe_compile(None).compile and not fake_compiles
