"""``executor=sim``: virtual-clock metrics from predicted step times, real-time sleeping, synthetic outputs
(EOS, speculative acceptance, grammar-valid tokens), profiles (``servelab profile``, ``auto`` measuring on
first use), and the refusals. The replay test is ``test_sim_replay.py``; the served run ``test_sim_serve.py``."""

from __future__ import annotations

import time

import pytest
from helpers import REPO, STORIES, STORIES_DRAFT
from sim_helpers import linear_profile

from framework import build_engine, registry
from framework.config import EngineConfig
from framework.core.sampling_params import SamplingParams
from framework.core.structured_output_params import StructuredOutputsParams
from framework.entrypoints.offline_runner import run_workload
from framework.interfaces import Executor
from framework.sim.outputs import AcceptanceModel
from framework.workloads.item import WorkloadItem


def _engine(tmp_path, const_s=0.05, params=None, **knobs):
    profile = linear_profile(tmp_path / "profile.json", const_s, **knobs.pop("per_unit_s", {}))
    knobs.setdefault("compile", False)
    return build_engine(EngineConfig(model=STORIES, executor="sim",
                                     executor_params={"profile": profile, **(params or {})}, **knobs))


def test_virtual_clock_metrics_follow_the_predicted_step_times(tmp_path):
    """Constant 50 ms steps plus 2 ms per prefill token: every latency is known in advance."""
    engine = _engine(tmp_path, per_unit_s={"prefill_tokens": 0.002})
    items = [WorkloadItem("a", prompt_token_ids=list(range(3, 13)), max_tokens=4),
             WorkloadItem("b", prompt_token_ids=list(range(3, 8)), max_tokens=3, arrival_time_s=1.0)]
    start = time.perf_counter()
    records, summary = run_workload(engine, items, SamplingParams(temperature=0.0, ignore_eos=True), progress=False)
    assert time.perf_counter() - start < 1.0  # a virtual second of idling costs no wall time
    a, b = (r["metrics"] for r in records)
    assert a["ttft_s"] == pytest.approx(0.05 + 10 * 0.002) and a["tpot_s"] == pytest.approx(0.05)
    assert a["e2e_s"] == pytest.approx(0.07 + 3 * 0.05) and a["itl_s"] == pytest.approx([0.05] * 3)
    assert b["ttft_s"] == pytest.approx(0.05 + 5 * 0.002) and b["queue_s"] == pytest.approx(0.0)
    assert b["e2e_s"] == pytest.approx(0.06 + 2 * 0.05)  # arrived at 1 s, when the engine had long been idle
    assert summary["duration_s"] == pytest.approx(1.0 + 0.16)
    assert summary["output_throughput"] == pytest.approx(7 / 1.16)
    assert summary["simulated"] is True and summary["sim_profile"] == "measured:constant@?"
    assert summary["num_steps"] == 4 + 3 and summary["step_s"] == pytest.approx(0.22 + 0.16)
    assert records[0]["simulated"] is True and len(records[0]["token_ids"]) == 4
    assert engine.executor.run_labels() == {"simulated": True, "sim_profile": "measured:constant@?"}
    engine.shutdown()


def test_queueing_follows_from_the_simulated_batch(tmp_path):
    """max_num_seqs=1: the second request waits exactly the first one's service time."""
    engine = _engine(tmp_path, max_num_seqs=1)
    items = [WorkloadItem(rid, prompt_token_ids=[5, 6, 7], max_tokens=3) for rid in ("a", "b")]
    records, _ = run_workload(engine, items, SamplingParams(ignore_eos=True), progress=False)
    assert records[1]["metrics"]["queue_s"] == pytest.approx(3 * 0.05)
    assert records[1]["metrics"]["ttft_s"] == pytest.approx(4 * 0.05)
    engine.shutdown()


def test_realtime_clock_sleeps_the_predicted_time(tmp_path):
    engine = _engine(tmp_path, const_s=0.03, params={"clock": "realtime"})
    assert engine.clock.realtime
    start = time.perf_counter()
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - start
    assert 5 * 0.03 <= elapsed < 5 * 0.03 + 1.0
    assert 0.025 < engine.metrics.summary()["mean_tpot_ms"] / 1000 < 0.06
    engine.shutdown()


def test_output_lengths_come_from_max_tokens_or_an_eos_probability(tmp_path):
    engine = _engine(tmp_path, params={"eos_probability": 0.25, "seed": 3})
    params = SamplingParams(max_tokens=64)
    for i in range(40):
        engine.add_request(f"r{i}", [5, 6, 7, 8], params)
    lengths = []
    while engine.has_unfinished_requests():
        lengths += [len(o.outputs[0].token_ids) for o in engine.step() if o.finished]
    assert len(lengths) == 40 and 2.5 < sum(lengths) / 40 < 6.0  # geometric, mean 1 / 0.25 = 4
    assert max(lengths) < 64
    engine.shutdown()


def test_speculative_decoding_accepts_at_the_given_rate_and_loads_no_drafter(tmp_path):
    engine = _engine(tmp_path, drafter="draft_model", drafter_params={"model": STORIES_DRAFT, "num_speculative_tokens": 3},
                     params={"acceptance": {"draft_model": 0.6}, "draft_step_s": 0.004})
    for i in range(16):
        engine.add_request(f"r{i}", [5, 6, 7, 8], SamplingParams(max_tokens=60, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    summary = engine.metrics.summary()
    assert summary["spec_acceptance_rate"] == pytest.approx(0.6, abs=0.06)
    conditional = AcceptanceModel.from_overall_rate(0.6, 3).rates[0]
    assert summary["spec_acceptance_by_position"] == pytest.approx([conditional] * 3, abs=0.1)
    assert 1.5 < summary["tokens_per_forward"] < 3.0 and summary["total_output_tokens"] == 16 * 60
    assert engine.drafter.name == "draft_model (simulated)" and not hasattr(engine.drafter, "runner")
    with pytest.raises(ValueError, match="acceptance has no entry for drafter 'ngram'"):  # a drafter the rates omit
        engine.executor.simulated_drafter(registry.create("drafter", "ngram", num_speculative_tokens=2))
    # Executor.simulated_drafter: the sim's stand-in above; the base executor's None means "load the real one"
    assert Executor.simulated_drafter(engine.executor, engine.drafter) is None
    assert summary["step_s"] >= summary["num_steps"] * 0.05  # each verify step also pays 3 x 4 ms of drafting
    engine.shutdown()


def test_structured_requests_get_grammar_valid_tokens_and_pay_the_mask(tmp_path):
    engine = _engine(tmp_path, params={"grammar_mask_s": 0.01})
    json_object = StructuredOutputsParams(json_object=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=24, structured_outputs=json_object))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert len(outputs) == 4 and all(o.error is None for o in outputs)  # every token passed the real matcher
    rows = sum(len(o.outputs[0].token_ids) for o in outputs)
    summary = engine.metrics.summary()
    assert summary["step_s"] == pytest.approx(summary["num_steps"] * 0.05 + rows * 0.01)
    engine.shutdown()


def test_analytic_llama3_70b_tp8_runs_a_shared_prefix_trace_in_seconds():
    """Llama-3-70B's shapes only (no weights): the device's memory model sizes the pool."""
    from framework.entrypoints.hydra_config import engine_config_from_cfg
    from framework.entrypoints.profile import compose_config
    from framework.workloads.workload import build_workload

    cfg = compose_config(["model=llama3_70b", "executor=sim", "executor.params.profile=analytic:h100",
                          "parallel.tensor_parallel_size=8", "workload=shared_prefix", "workload.num_prefixes=8",
                          "workload.questions_per_prefix=25", "workload.request_rate=50", "tracker=none"])
    engine = build_engine(engine_config_from_cfg(cfg))
    items = build_workload(cfg.workload, engine.tokenizer, vocab_size=engine.vocab_size,
                           max_model_len=engine.max_model_len)
    start = time.perf_counter()
    _, summary = run_workload(engine, items, SamplingParams(max_tokens=32, ignore_eos=True), progress=False)
    assert time.perf_counter() - start < 20
    assert summary["num_requests"] == 200 and summary["sim_profile"] == "analytic:h100"
    assert 70_000 < summary["kv_cache_num_blocks"] < 90_000  # ~52 GB per rank / 640 KiB per 16-token block
    assert summary["prefix_cache_hit_rate"] > 0.8 and 0 < summary["mean_tpot_ms"] < 100
    engine.shutdown()


def test_servelab_profile_quick_grid_then_simulating_with_it(tmp_path, capsys):
    from framework.entrypoints.cli import main

    out = tmp_path / "stories.json"
    assert main(["profile", "model=stories260K", "engine.compile=false", "--grid", "quick", "--out", str(out)]) == 0
    assert "held-out step-time error" in capsys.readouterr().out
    from framework.sim.profile import StepProfile

    profile = StepProfile.load(out)
    assert profile.source == "measured" and profile.key["device"].startswith("cpu:") and len(profile.samples) > 36
    assert profile.grammar_mask_s_per_row > 0
    engine = build_engine(EngineConfig(model=STORIES, compile=False, executor="sim",
                                       executor_params={"profile": str(out)}))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.metrics.summary()["sim_profile"].startswith("measured:stories260K@cpu:")
    engine.shutdown()


def test_profile_auto_measures_once_and_caches(tmp_path, monkeypatch, capsys):
    from framework.engine import profiler

    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    monkeypatch.setitem(profiler.GRIDS, "default", profiler.GRIDS["quick"])  # keep the first-use measuring short
    config = EngineConfig(model=STORIES, compile=False, executor="sim", executor_params={"profile": "auto"})
    build_engine(config).shutdown()
    out = capsys.readouterr().out
    assert "measuring one with the real engine" in out
    cells = len(profiler.GRIDS["quick"])  # the run says where it is: once warmed up, then after each cell with an ETA
    assert f"engine built and warmed up; measuring {cells} cells" in out
    assert f"cell {cells}/{cells}: " in out and "s left" in out
    assert len(list((tmp_path / "profiles").glob("stories260K--cpu*.json"))) == 1
    build_engine(config).shutdown()
    assert "measuring" not in capsys.readouterr().out  # found in the cache


def test_analytic_profile_file_from_servelab_profile(tmp_path):
    from framework.entrypoints.cli import main
    from framework.sim.profile import StepProfile

    out = tmp_path / "h100.json"
    assert main(["profile", "model=llama3_70b", "parallel.tensor_parallel_size=8", "device=h100", "--out", str(out)]) == 0
    profile = StepProfile.load(out)
    assert profile.source == "analytic" and profile.key["tensor_parallel_size"] == 8
    engine = build_engine(EngineConfig(model=str(REPO / "models" / "llama-3-70b"), tokenizer="smollm2", compile=False,
                                       executor="sim", tensor_parallel_size=8, executor_params={"profile": str(out)}))
    assert engine.metrics.summary()["sim_profile"] == "analytic:h100"
    engine.shutdown()


@pytest.mark.parametrize("params, message", [
    ({"clock": "wall"}, "clock must be virtual or realtime"),
    ({"profile": "analytic:tpu"}, "unknown device"),
    ({"profile": "/no/such/profile.json"}, "no such profile file"),
    ({"memory": "gpu"}, "memory must be auto or engine"),
    ({"bogus": 1}, "unknown params"),
])
def test_bad_parameters_are_refused_before_anything_loads(params, message):
    with pytest.raises(ValueError, match=message):
        build_engine(EngineConfig(model=STORIES, executor="sim", executor_params=params))


def test_spec_decode_without_an_acceptance_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs executor.params.acceptance"):
        _engine(tmp_path, drafter="ngram")


def test_compile_auto_keeps_a_simulated_engine_on_its_profile(tmp_path):
    """engine.compile=auto on executor=sim measures nothing and compiles nothing: the step times are the
    profile's (a real engine's auto would time eager decode steps on the rank)."""
    engine = _engine(tmp_path, compile="auto")
    decision = engine.maybe_compile([4096] * 64)
    assert decision.compile is False and "simulates the model" in decision.reason
    assert engine.metrics.compile_stats.current().active is False
    engine.shutdown()
