"""``engine.compile=auto|true|false``: the rule (no model), and how the engine applies it (stories260K, the
compile itself faked: ``tests/framework/compilation/test_decoder.py`` compiles for real the same way)."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import pytest
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS
from hypothesis import given
from hypothesis import strategies as st

from framework import EngineConfig, SamplingParams
from framework.compilation import policy as compile_policy
from framework.compilation.calibration import CompilePlanner
from framework.compilation.decoder import CompileStats
from framework.compilation.policy import CompileCosts, decide_compile, decode_schedule, output_budget

REAL_DECIDE = CompilePlanner.decide  # captured at import, before conftest's session patch keeps auto eager


def _costs(warm_up_s=10.0, eager=None, compiled=None):
    return CompileCosts(warm_up_s, "test", eager or {1: 30.0, 64: 180.0}, compiled or {}, "test")


#: A calibration record as the 2-core EPYC measured SmolLM2 bf16 (docs/results/compile.md): eager and compiled
#: decode steps at batch 1 and 64, ms, and the compile warm-up from inductor's cache, s.
EPYC = CompileCosts(3.9, "cached estimate from the cold one measured here", {1: 29.3, 64: 81.2}, {1: 14.8, 64: 61.1},
                    "eager and compiled measured here")
W = [128] * 64  # issue 43's W: 64 prompts x 128 output tokens
W2 = [16 + round(240 * i / 63) for i in range(64)]  # its W2: 64 prompts, budgets spread evenly over 16..256


def test_forced_modes_and_open_ended_work():
    assert decide_compile("true", [0]).compile and not decide_compile("false", [10**9]).compile
    server = decide_compile("auto", None)
    assert server.compile and "server" in server.reason
    none = decide_compile("auto", [10**9], costs=None)
    assert not none.compile and "no decode step time measured" in none.reason


def test_a_uniform_batch_saves_at_its_batch_size():
    """W: 128 steps at batch 64, 20.1 ms saved each = 2.6 s < 3.9 s: eager for one run; two runs pay."""
    once = decide_compile("auto", W, EPYC)
    assert not once.compile and "engine.compile=true forces it" in once.reason
    assert "~2.6 s saved over 128 decode steps (batch 64→64) of 64 requests' 8,192-token budget" in once.reason
    assert once.estimate["saving_s"] == pytest.approx(128 * 20.1 / 1e3, abs=0.01)
    assert once.estimate["step_ms"] == {"64": {"eager": 81.2, "compiled": 61.1}}
    twice = decide_compile("auto", W, EPYC, repeats=2)
    assert twice.compile and "256 decode steps" in twice.reason and "x 2 runs" in twice.reason


def test_a_mixed_batch_counts_its_shrinking_tail():
    """W2 (issue 43's miss): its 8,704 tokens at batch 64 alone would save 136 x 20.1 ms = 2.7 s < 3.9 s; the batch
    shrinks from 64 to 1 as requests finish, and each step at a small batch saves ~15 ms for fewer tokens."""
    decision = decide_compile("auto", W2, EPYC)
    assert sum(W2) / 64 * 20.1 / 1e3 < EPYC.warm_up_s < decision.estimate["saving_s"]
    assert decision.compile and "engine.compile=false skips it" in decision.reason
    assert "saved over 256 decode steps (batch 64→1) of 64 requests' 8,704-token budget" in decision.reason
    assert decision.estimate["batch_first"] == 64 and decision.estimate["batch_last"] == 1
    expected = sum(EPYC.step_saving_ms(sum(b >= t for b in W2)) for t in range(1, 257)) / 1e3
    assert decision.estimate["saving_s"] == pytest.approx(expected, abs=0.01)


def test_a_long_batch_1_run_compiles_and_a_tiny_job_stays_eager():
    long = decide_compile("auto", [1000], EPYC)  # 1000 steps x 14.5 ms = 14.5 s
    assert long.compile and "~14.5 s saved over 1,000 decode steps (batch 1→1) of 1 request's" in long.reason
    cold = dataclasses.replace(EPYC, warm_up_s=40.0, warm_up_source="prior, cold")
    assert not decide_compile("auto", [1000], cold).compile and decide_compile("auto", [3000], cold).compile
    tiny = decide_compile("auto", [16, 16], EPYC)
    assert not tiny.compile and tiny.estimate["decode_steps"] == 16 and tiny.estimate["saving_s"] < 0.5


def test_on_an_avx2_cpu_a_batch_1_run_that_pays_back_a_cached_compile_compiles():
    """A 2-core AMD Zen 3 (AVX2 only, float32 by dtype=auto): batch-1 steps of 59.0 ms eager and 28.6 ms
    compiled (issue 65's bench), a compile measured here before and cached (6.3 s): 128 tokens save ~3.9 s and
    stay eager, 256 tokens save ~7.8 s and compile; with only the cold prior (40 s) both stay eager."""
    zen3 = CompileCosts(6.3, "measured here, from inductor's cache", {1: 59.0, 64: 180.0}, {1: 28.6, 64: 120.0},
                        "eager and compiled measured here")
    assert not decide_compile("auto", [128], zen3).compile
    assert decide_compile("auto", [256], zen3).compile
    cold = dataclasses.replace(zen3, warm_up_s=40.0, warm_up_source="prior, cold")
    assert not decide_compile("auto", [256], cold).compile and decide_compile("auto", [1400], cold).compile


def test_the_readme_main_job_stays_eager_on_a_fresh_machine():
    """``python run.py``: 72 prompts x 64 tokens; eager steps measured, compiled ones and the warm-up prior."""
    fresh = CompileCosts(40.0, "prior, cold", {1: 29.3, 64: 81.2}, {}, "eager measured here, compiled prior")
    decision = decide_compile("auto", [64] * 72, fresh)
    assert not decision.compile and "~40.0 s warm-up (prior, cold) vs ~1.4 s saved over 64 decode steps" in decision.reason


def test_steps_run_so_far_count_toward_the_saving():
    """The ski-rental rule: a loop of small calls compiles once it has spent what compiling would have saved."""
    assert not decide_compile("auto", [4, 4], EPYC, past_steps={1: 200}).compile  # 2.9 s + 0.1 s < 3.9 s
    decision = decide_compile("auto", [4, 4], EPYC, past_steps={1: 300})
    assert decision.compile and "~4.3 s over the 300 decode steps run eagerly so far" in decision.reason
    assert decision.estimate["past_decode_steps"] == 300 and decision.estimate["planned_saving_s"] < 0.2


def test_no_work_at_all_saves_nothing():
    decision = decide_compile("auto", [], EPYC)
    assert not decision.compile and decision.estimate["decode_steps"] == 0 and "0 decode steps" in decision.reason


@pytest.mark.parametrize(("budgets", "max_num_seqs", "steps"), [
    ([3, 1, 2], 8, {3: 1, 2: 1, 1: 1}),
    ([2, 2, 2], 2, {2: 2, 1: 2}),  # the third request waits for a seat
    ([3, 1, 1], 2, {2: 2, 1: 1}),  # and takes the first one freed
    ([0, 5], 4, {1: 5}),  # a zero budget runs no step
    ([], 4, {}),
])
def test_decode_schedule(budgets, max_num_seqs, steps):
    assert decode_schedule(budgets, max_num_seqs) == steps


@given(st.lists(st.integers(0, 40), max_size=30), st.integers(1, 40))
def test_decode_schedule_runs_every_token_and_matches_the_admitted_at_once_count(budgets, max_num_seqs):
    steps = decode_schedule(budgets, max_num_seqs)
    assert sum(batch * n for batch, n in steps.items()) == sum(budgets)  # one token per request per step
    assert all(1 <= batch <= max_num_seqs for batch in steps)
    if len(budgets) <= max_num_seqs:  # step t runs every request whose budget reaches t
        expected = Counter(sum(b >= t for b in budgets) for t in range(1, max(budgets, default=0) + 1))
        assert steps == dict(expected)


def test_output_budget():
    calls = []

    def tokenize(text):
        calls.append(text)
        if text == "too long":
            raise ValueError("prompt has too many tokens")
        return [1] * len(text)

    assert output_budget(16, [1, 2, 3], 100) == 16 and output_budget(200, [1] * 10, 100) == 90
    assert output_budget(None, [1] * 10, 100) == 90 and output_budget(None, None, 100) == 100
    assert output_budget(16, "hello", 100, tokenize) == 16 and not calls  # no tokenizing when max_tokens is set
    assert output_budget(None, "hello", 100, tokenize) == 95 and calls == ["hello"]
    assert output_budget(None, "too long", 100, tokenize) == 0  # the engine will refuse it


def test_step_times_interpolate_and_use_measured_compiled_steps():
    costs = _costs(compiled={1: 10.0, 64: 100.0})
    assert costs.step_ms(1, compiled=False) == 30.0 and costs.step_ms(64, compiled=True) == 100.0
    assert costs.step_ms(32, compiled=False) == pytest.approx(30 + 150 * 31 / 63)
    assert costs.step_ms(128, compiled=True) == pytest.approx(10 + 90 * 127 / 63)  # extrapolated
    assert _costs().step_ms(1, compiled=True) == 15.0  # prior ratio 0.5 at batch 1
    # the prior ratio is held at its end (0.75) past batch 64, never extrapolated past eager
    assert _costs().step_ms(256, compiled=True) == pytest.approx(0.75 * _costs().step_ms(256, compiled=False))
    # a compiled line steeper than eager's: extrapolated far, compiling saves nothing, never less
    steep = _costs(eager={1: 30.0, 64: 60.0}, compiled={1: 10.0, 64: 59.0})
    assert steep.step_saving_ms(64) == pytest.approx(1.0) and steep.step_saving_ms(256) == 0.0


class FakeExecutor:
    """``collective_rpc`` for the planner: ``time_decode_steps`` answers fixed times."""

    def __init__(self, times):
        self.times, self.calls = times, 0

    def collective_rpc(self, method, args=(), unique_reply_rank=None):
        assert method == "time_decode_steps" and list(args[0]) == [1, 64]
        self.calls += 1
        return [dict(self.times)]


def test_planner_measures_once_and_keeps_the_warm_up(tmp_path, monkeypatch):
    from framework.compilation import calibration as compile_calibration

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    monkeypatch.setattr(compile_calibration, "_inductor_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(compile_calibration.CompilePlanner, "decide", REAL_DECIDE)
    executor = FakeExecutor({1: 30.0, 64: 180.0})
    planner = CompilePlanner(EngineConfig(model=STORIES), executor)
    assert not planner.decide([100], {}, lambda: False).compile and executor.calls == 0  # busy: nothing measured
    decision = planner.decide([100], {}, lambda: True)
    assert executor.calls == 1 and "prior, cold" in decision.reason and not decision.compile
    assert planner.decide([100], {}, lambda: True) and executor.calls == 1  # measured once per machine and model
    # a cold compile measured here, then one from inductor's cache
    executor.times = {1: 12.0, 64: 120.0}
    planner.record_compile(CompileStats(enabled=True, active=True, compile_s=30.0, num_cache_misses=3))
    costs = planner.costs(planner.load())
    assert costs.compiled_step_ms == {1: 12.0, 64: 120.0} and costs.warm_up_source.startswith("cached estimate")
    planner.record_compile(CompileStats(enabled=True, active=True, compile_s=4.0, num_cache_misses=0))
    costs = planner.costs(planner.load())
    assert costs.warm_up_s == 4.0 and costs.warm_up_source == "measured here, from inductor's cache"
    assert planner.decide([300], {}, lambda: True).compile  # 300 steps at batch 1 x 18 ms = 5.4 s > 4 s
    assert not planner.decide([100], {}, lambda: True).compile  # 1.8 s
    assert planner.decide([100], {1: 200}, lambda: True).compile  # + 200 steps run so far x 18 ms = 5.4 s
    assert planner.decide([100], {}, lambda: True, repeats=3).compile
    monkeypatch.setattr(compile_calibration, "_inductor_cache_dir", lambda: str(tmp_path / "gone"))
    assert planner.costs(planner.load()).warm_up_s == 30.0  # the cache it was measured with is gone: cold
    other = CompilePlanner(EngineConfig(model=STORIES, dtype="bfloat16"), executor)
    assert other.path != planner.path and other.load() == {}


class BusyThenQuietExecutor(FakeExecutor):
    """Answers each set of ``times`` in turn (the last one again after that)."""

    def __init__(self, *sets):
        super().__init__(sets[0])
        self.sets = list(sets)

    def collective_rpc(self, method, args=(), unique_reply_rank=None):
        self.times = self.sets[min(self.calls, len(self.sets) - 1)]
        return super().collective_rpc(method, args, unique_reply_rank)


def test_planner_measures_again_when_a_larger_batch_stepped_faster(tmp_path, monkeypatch):
    from framework.compilation import calibration as compile_calibration

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    planner = CompilePlanner(EngineConfig(model=STORIES), BusyThenQuietExecutor({1: 505.0, 64: 92.0}, {1: 30.0, 64: 95.0}))
    assert planner.measure_steps() == {"1": 30.0, "64": 92.0} and planner.executor.calls == 2  # the fastest of each
    stuck = CompilePlanner(EngineConfig(model=STORIES), BusyThenQuietExecutor({1: 505.0, 64: 92.0}))
    assert stuck.measure_steps() == {"1": 505.0, "64": 92.0} and stuck.executor.calls == 3  # kept after 3 tries


def test_real_decode_steps_scale_the_dummy_steps(tmp_path, monkeypatch):
    """Real all-decode steps 1.5x the dummy ones scale eager (and, until compiled steps ran, compiled) step times;
    real compiled steps give compiled its own factor; thin batch sizes are ignored; junk is clamped."""
    from framework.compilation import calibration as compile_calibration

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    monkeypatch.setattr(compile_calibration, "_inductor_cache_dir", lambda: str(tmp_path))
    planner = CompilePlanner(EngineConfig(model=STORIES), FakeExecutor({1: 30.0, 64: 180.0}))
    planner.save({"eager_step_ms": planner.measure_steps()})
    for _ in range(10):
        planner.observe_decode_step(64, 0.270, compiled=False)
    planner.observe_decode_step(1, 9.0, compiled=False)  # one step of a batch size: too thin to count
    planner.flush_observed(force=False)
    assert "observed_step_ms" not in planner.load()  # 11 steps pending < FLUSH_EVERY_STEPS: not written yet
    planner.flush_observed()
    costs = planner.costs(planner.load())
    assert costs.eager_step_ms == pytest.approx({1: 45.0, 64: 270.0})
    assert "x1.50 as 10 real eager decode steps ran" in costs.step_source
    assert costs.step_ms(64, compiled=True) == pytest.approx(0.75 * 270.0)  # prior ratio on the scaled eager
    planner.executor.times = {1: 12.0, 64: 120.0}
    planner.record_compile(CompileStats(enabled=True, active=True, compile_s=4.0, num_cache_misses=0))
    costs = planner.costs(planner.load())
    assert costs.compiled_step_ms == pytest.approx({1: 18.0, 64: 180.0})  # the eager factor, no compiled steps yet
    for _ in range(5):
        planner.observe_decode_step(64, 0.240, compiled=True)
    planner.flush_observed()
    costs = planner.costs(planner.load())
    assert costs.compiled_step_ms == pytest.approx({1: 24.0, 64: 240.0}) and "compiled x2.00" in costs.step_source
    assert costs.eager_step_ms == pytest.approx({1: 45.0, 64: 270.0})
    record = planner.load()["observed_step_ms"]
    assert record["eager"]["64"] == [270.0, 10] and record["compiled"]["64"] == [240.0, 5]
    for _ in range(compile_calibration.MAX_OBSERVED_WEIGHT):  # a long loaded run: the mean moves, clamped at 3x
        planner.observe_decode_step(64, 100.0, compiled=False)
    planner.flush_observed()
    assert planner.load()["observed_step_ms"]["eager"]["64"][1] == compile_calibration.MAX_OBSERVED_WEIGHT
    assert planner.costs(planner.load()).eager_step_ms == pytest.approx({1: 90.0, 64: 540.0})


def test_an_engine_reports_its_real_decode_steps(make_llm, tmp_path, monkeypatch):
    from framework.compilation import calibration as compile_calibration

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    llm = make_llm(compile=False)
    llm.generate(STORY_PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    llm.engine.maybe_compile([1])  # flushes what the call ran
    eager = llm.engine.compile_planner.load()["observed_step_ms"]["eager"]
    assert eager["3"][1] >= 9 and eager["3"][0] > 0  # 3 prompts: one prefill step, then decodes at batch 3


@pytest.mark.parametrize(("value", "mode"), [(True, "true"), (False, "false"), ("auto", "auto"), ("false", "false")])
def test_config_normalizes_the_mode(value, mode):
    assert EngineConfig(model="m", compile=value).compile == mode


def test_config_refuses_other_modes():
    with pytest.raises(ValueError, match="compile must be auto, true or false"):
        EngineConfig(model="m", compile="sometimes")
    with pytest.raises(ValueError, match="compile_backend must be inductor or eager"):
        EngineConfig(model="m", compile_backend="aot_eager")


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
    from framework.compilation import calibration as compile_calibration
    from framework.worker.model_runner import ModelRunner

    monkeypatch.setattr(compile_calibration, "calibration_dir", lambda: tmp_path)
    monkeypatch.setattr(compile_calibration.CompilePlanner, "decide", REAL_DECIDE)
    monkeypatch.setattr(compile_policy, "PRIOR_WARM_UP_S", {"cold": 1.0, "cached": 1.0})
    monkeypatch.setattr(ModelRunner, "time_decode_steps", lambda runner, sizes: {1: 30.0, 64: 180.0})
    # the tiny model's real steps (~1 ms) would scale those numbers down: the fake ones stand
    monkeypatch.setattr(compile_calibration.CompilePlanner, "observe_decode_step", lambda *args, **kwargs: None)


def test_auto_compiles_before_the_call_that_pays(make_llm, real_planner, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm = make_llm()
    assert "engine.compile=auto: eager for now" in caplog.text
    cached_at_compile = []  # was any prefix still cached when the (faked) compile ran?
    monkeypatch.setattr(type(llm.engine.runner), "compile_decoder",
                        lambda runner: cached_at_compile.append(bool(llm.engine.kv_allocator._cached)))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm.generate(PREFIX_PROMPTS[:2], params)  # 8 steps at batch 2: ~0.13 s saved < 1 s
    assert not cached_at_compile and "eager, ~1.0 s warm-up (prior, cold)" in caplog.text
    assert llm.engine.kv_allocator._cached  # the first call's prefixes are cached
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        # 62 steps at batch 1 save 0.93 s; with the first call's 8 steps at batch 2, 1.06 s > 1 s
        llm.generate(STORY_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=62))
    assert cached_at_compile == [False]  # compiled once, after the prefix cache was dropped
    summary = llm.engine.metrics.summary()
    assert summary["compile_mode"] == "auto" and "compiling, ~1.0 s warm-up" in summary["compile_reason"]
    estimate = summary["compile_estimate"]
    assert estimate["output_tokens"] == 62 and estimate["batch_first"] == estimate["batch_last"] == 1
    assert estimate["past_decode_steps"] >= 8 and "decode steps run eagerly so far" in summary["compile_reason"]


def test_auto_puts_the_compile_off_while_requests_hold_blocks(make_llm, fake_compiles, real_planner):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("busy", STORY_PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()  # the request now owns KV blocks
    decision = engine.maybe_compile([1000])
    assert not decision.compile and "no decode step time measured" in decision.reason and not fake_compiles
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.maybe_compile([1000]).compile and len(fake_compiles) == 1


def test_forced_modes_ignore_the_work(make_llm, fake_compiles):
    llm = make_llm(compile=False)
    assert not llm.engine.maybe_compile(None).compile and not fake_compiles


def test_generate_tells_each_requests_budget(make_llm, monkeypatch):
    """``LLM.generate`` passes one budget per sample: ``max_tokens``, or ``max_model_len`` minus the prompt."""
    llm = make_llm(compile=False, max_model_len=64)
    told = []
    monkeypatch.setattr(llm.engine, "maybe_compile", lambda budgets, repeats=1: told.append(budgets))
    llm.generate([[5, 6, 7], STORY_PROMPTS[0]], [SamplingParams(max_tokens=None, n=2, temperature=0.8),
                                                 SamplingParams(max_tokens=4)])
    assert told == [[61, 61, 4]]
