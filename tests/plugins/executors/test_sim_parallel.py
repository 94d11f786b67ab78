"""``executor=sim`` prices pipeline parallelism (GPipe bubbles, stage hand-offs) and expert parallelism (all-to-all
bytes, expert imbalance) in its analytic roofline (``framework/sim/parallel_cost.py``); with neither, the step
times are the ones the roofline gave before they existed, to the last bit."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import REPO

from framework.config import EngineConfig
from framework.model_executor.model_loader import load_model_config
from framework.sim.features import StepFeatures
from framework.sim.memory import kv_cache_bytes_per_block, weight_bytes_per_rank
from framework.sim.parallel_cost import all_to_all_bytes, expert_imbalance, pipeline_bubble_fraction
from framework.sim.roofline import COLLECTIVE_LATENCY_S, LINK_EFFICIENCY, RooflineStepModel

LLAMA = str(REPO / "models" / "llama-3-70b")
MIXTRAL = str(REPO / "experiments" / "sim" / "shapes" / "mixtral-8x22b")
DECODE = StepFeatures(num_tokens=64, num_reqs=64, num_decode_reqs=64, num_prefill_reqs=0, num_sampled=64,
                      decode_context=64 * 1500, max_decode_context=2000, decode_unique_context=64 * 1500,
                      prefill_context=0, prefill_pairs=0)
MIXED = StepFeatures(num_tokens=2048, num_reqs=3, num_decode_reqs=1, num_prefill_reqs=2, num_sampled=2,
                     decode_context=700, max_decode_context=700, decode_unique_context=700, prefill_context=2100,
                     prefill_pairs=1500000, num_swap_blocks=4)
# (model, tp, features) -> (step_s, execute_s) of the roofline before pipeline and expert parallelism were priced
BEFORE = {(LLAMA, 1, DECODE): (0.06572552463283582, 0.06440552463283582),
          (LLAMA, 1, MIXED): (0.4164666057886802, 0.41545160578868023),
          (LLAMA, 8, DECODE): (0.012603442839137648, 0.011283442839137646),
          (LLAMA, 8, MIXED): (0.0850726125013628, 0.0840576125013628),
          (MIXTRAL, 1, DECODE): (0.11489057184477612, 0.11357057184477612),
          (MIXTRAL, 1, MIXED): (0.2358400612903563, 0.23482506129035632),
          (MIXTRAL, 8, DECODE): (0.017616170475621893, 0.01629617047562189),
          (MIXTRAL, 8, MIXED): (0.047636867594627874, 0.04662186759462787)}


def _model(path: str, tp: int = 8, **knobs) -> RooflineStepModel:
    params = knobs.pop("params", {})
    config = EngineConfig(model=path, executor="sim", dtype="bfloat16", tensor_parallel_size=tp,
                          executor_params={"profile": "analytic:h100", **params}, **knobs)
    return RooflineStepModel("h100", load_model_config(path), config)


@pytest.mark.parametrize("key", list(BEFORE), ids=lambda k: f"{k[0].rsplit('/', 1)[1]}-tp{k[1]}-{k[2].num_tokens}")
def test_pp1_and_ep_off_reproduce_the_roofline_exactly(key):
    path, tp, features = key
    predicted = _model(path, tp).predict(features)
    assert (predicted.step_s, predicted.execute_s) == BEFORE[key]


def test_bubble_fraction_matches_gpipe_and_the_step_follows_the_schedule():
    """k stages, m microbatches: (m + k - 1) slots of the busiest stage plus k - 1 hand-offs, a bubble of
    (k - 1) / (m + k - 1) of the stage-time; the memory-bound decode rereads each stage's weights per microbatch."""
    assert pipeline_bubble_fraction(4, 4) == pytest.approx(3 / 7) and pipeline_bubble_fraction(1, 1) == 0.0
    with pytest.raises(ValueError, match="microbatch"):
        pipeline_bubble_fraction(0, 2)
    k, m = 4, 8
    model = _model(LLAMA, 2, pipeline_parallel_size=k, params={"pp_microbatches": m})
    stage_model = _model(LLAMA, 2)  # the same TP group running all layers: its parts, scaled to one stage
    micro = StepFeatures(**{name: value / m for name, value in DECODE.as_dict().items()})
    linear, head, attention, collectives = stage_model._parts(micro)
    layers = linear + attention + collectives + model.num_layers * 10e-6
    stage_s = layers * 20 / 80 + head
    handoff_s = (k - 1) * (64 / m * 8192 * 2 / (450e9 * LINK_EFFICIENCY) + COLLECTIVE_LATENCY_S)
    predicted = model.predict(DECODE)
    assert predicted.execute_s == pytest.approx(stage_s * (m + k - 1) + handoff_s, rel=1e-12)
    assert model.pipeline_bubble_s / (model.pipeline_bubble_s + model.pipeline_busy_s) == pytest.approx(
        pipeline_bubble_fraction(m, k))
    few = _model(LLAMA, 2, pipeline_parallel_size=k, params={"pp_microbatches": m})
    few.predict(dataclasses.replace(MIXED))  # 3 requests: at most 3 microbatches
    assert few.pipeline_bubble_s / (few.pipeline_bubble_s + few.pipeline_busy_s) == pytest.approx(
        pipeline_bubble_fraction(3, k))


def test_a_compute_bound_step_costs_max_stage_time_times_the_gpipe_factor():
    """A big prefill is compute-bound: splitting it into m microbatches divides the stage time by m, so the step is
    the whole-batch stage time x (m + k - 1) / m, plus hand-offs (the textbook formula)."""
    k, m = 2, 2
    prefill = StepFeatures(num_tokens=8192, num_reqs=4, num_decode_reqs=0, num_prefill_reqs=4, num_sampled=4,
                           decode_context=0, max_decode_context=0, decode_unique_context=0, prefill_context=8192,
                           prefill_pairs=4 * 2048 * 2049 // 2)
    whole = _model(LLAMA, 8)
    linear, head, attention, collectives = whole._parts(prefill)
    stage_batch = (linear + attention + collectives) / k  # launches and the head do not scale with tokens
    model = _model(LLAMA, 8, pipeline_parallel_size=k, params={"pp_microbatches": m})
    handoff = (k - 1) * (8192 / m * 8192 * 2 / (450e9 * LINK_EFFICIENCY) + COLLECTIVE_LATENCY_S)
    assert model.predict(prefill).execute_s == pytest.approx(stage_batch * (m + k - 1) / m + handoff, rel=0.02)


def test_pipeline_stages_hold_their_share_of_weights_and_kv():
    hf = load_model_config(LLAMA)
    one = EngineConfig(model=LLAMA, executor="sim", dtype="bfloat16", tensor_parallel_size=4)
    four = dataclasses.replace(one, pipeline_parallel_size=4)
    assert kv_cache_bytes_per_block(four, hf, 80) * 4 == kv_cache_bytes_per_block(one, hf, 80)
    assert weight_bytes_per_rank(four, hf) == pytest.approx(weight_bytes_per_rank(one, hf) / 4, abs=1)


def test_expert_parallel_prices_all_to_all_and_the_busiest_rank():
    """EP over 8 ranks: the all-to-all bytes of the formula, one all-reduce per layer instead of two, and a
    skewed router makes the step slower than a balanced one (the busiest rank sets the MoE time)."""
    assert all_to_all_bytes(64, 2, 6144, 2, 8) == 2 * 64 * 2 * 6144 * 2 * 7 / 8 / 8
    assert all_to_all_bytes(64, 2, 6144, 2, 1) == 0.0
    assert expert_imbalance(8, 4, loads=[4, 4, 1, 1, 1, 1, 1, 3]) == pytest.approx(8 / 4)  # ranks 8, 2, 2, 4
    with pytest.raises(ValueError, match="divide evenly"):
        expert_imbalance(8, 3)
    with pytest.raises(ValueError, match=">= 1"):
        expert_imbalance(8, 8, skew=0.5)
    balanced = _model(MIXTRAL, 8, enable_expert_parallel=True)
    skewed = _model(MIXTRAL, 8, enable_expert_parallel=True, params={"expert_skew": 2.0})
    measured = _model(MIXTRAL, 8, enable_expert_parallel=True, params={"expert_loads": [8, 1, 1, 1, 1, 1, 1, 2]})
    assert measured.plan.expert_imbalance == pytest.approx(8 / 2)
    big = dataclasses.replace(MIXED, num_tokens=8192)
    assert skewed.predict(big).execute_s > balanced.predict(big).execute_s
    assert measured.predict(big).execute_s > skewed.predict(big).execute_s
    _, _, _, collectives = balanced._parts(DECODE)
    link = 450e9 * LINK_EFFICIENCY
    allreduce = 2 * 7 / 8 * 64 * 6144 * 2 / link + COLLECTIVE_LATENCY_S
    assert collectives == pytest.approx(56 * (allreduce + all_to_all_bytes(64, 2, 6144, 2, 8) / link
                                              + 2 * COLLECTIVE_LATENCY_S))


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="needs a MoE model"):
        _model(LLAMA, 8, enable_expert_parallel=True)
    from plugins.executors.sim import SimExecutor

    config = EngineConfig(model=LLAMA, executor="sim", pipeline_parallel_size=2, executor_params={"profile": "auto"})
    assert any("profile=analytic" in p for p in SimExecutor.validate(config))
