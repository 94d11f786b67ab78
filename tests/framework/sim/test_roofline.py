"""The analytic roofline of a simulated device: plausible, monotonic, and sensitive to what it models."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import REPO

from framework.config import EngineConfig
from framework.model_executor.model_loader import load_model_config
from framework.sim.features import StepFeatures
from framework.sim.roofline import DEVICES, RooflineStepModel, analytic_profile

LLAMA70B = str(REPO / "models" / "llama-3-70b")


def _decode(batch: int, context: int) -> StepFeatures:
    return StepFeatures(num_tokens=batch, num_reqs=batch, num_decode_reqs=batch, num_prefill_reqs=0,
                        num_sampled=batch, decode_context=batch * context, max_decode_context=context,
                        decode_unique_context=batch * context, prefill_context=0, prefill_pairs=0)


def _prefill(tokens: int) -> StepFeatures:
    return StepFeatures(num_tokens=tokens, num_reqs=1, num_decode_reqs=0, num_prefill_reqs=1, num_sampled=1,
                        decode_context=0, max_decode_context=0, decode_unique_context=0, prefill_context=tokens,
                        prefill_pairs=tokens * (tokens + 1) // 2)


@pytest.fixture(scope="module")
def llama70b():
    return load_model_config(LLAMA70B)


def _model(hf, device="h100", tp=8, **kw):
    return RooflineStepModel(device, hf, EngineConfig(model=LLAMA70B, dtype="bfloat16", tensor_parallel_size=tp,
                                                      executor="sim", **kw))


def test_llama3_70b_tp8_h100_decode_and_prefill_are_plausible(llama70b):
    model = _model(llama70b)
    decode = model.predict(_decode(64, 2048)).execute_s
    assert 0.005 < decode < 0.05  # ~17.6 GB of weights and ~5 GB of KV per rank at ~2.7 TB/s: ~10 ms
    prefill = model.predict(_prefill(8192)).execute_s
    flops_per_rank = 2 * 8192 * 70e9 / 8
    assert flops_per_rank / (989e12 * 0.7) < prefill < 3 * flops_per_rank / (989e12 * 0.7)  # compute-bound


def test_more_work_never_takes_less_time(llama70b):
    model = _model(llama70b)
    times = [model.predict(_decode(b, c)).step_s for b, c in ((1, 128), (8, 128), (8, 4096), (256, 4096))]
    assert times == sorted(times)
    assert model.predict(_prefill(512)).step_s < model.predict(_prefill(4096)).step_s


def test_devices_and_tp_degree_change_what_they_should(llama70b):
    decode = _decode(32, 1024)
    h100, h200 = _model(llama70b).predict(decode).execute_s, _model(llama70b, "h200").predict(decode).execute_s
    assert h200 < h100  # same compute, more bandwidth: a memory-bound decode gets faster
    assert _model(llama70b, "a100").predict(_prefill(4096)).execute_s > _model(llama70b).predict(_prefill(4096)).execute_s
    assert _model(llama70b, tp=4).predict(_prefill(4096)).execute_s > _model(llama70b).predict(_prefill(4096)).execute_s
    assert _model(llama70b, quant="fp8").predict(decode).execute_s < h100  # half the weight bytes


def test_unknown_device_names_the_known_ones(llama70b):
    with pytest.raises(ValueError, match="h100, h200, a100, l4"):
        _model(llama70b, "tpu")
    assert set(DEVICES) == {"h100", "h200", "a100", "l4"}


def test_analytic_profile_is_labelled(llama70b):
    config = EngineConfig(model=LLAMA70B, dtype="bfloat16", tensor_parallel_size=8, executor="sim")
    profile = analytic_profile("h100", llama70b, config)
    assert profile.source == "analytic" and profile.key["device"] == "analytic:h100"
    assert profile.meta["device_name"].startswith("H100") and not profile.samples
    assert dataclasses.asdict(DEVICES["h100"])["memory_bytes"] == 80 * 10**9


def test_kv_traffic_is_the_cache_a_rank_holds(llama70b):
    """The roofline reads the cache the engine allocates: Llama-3-70B's 8 KV heads split over TP=8 (one K and one V
    head of 128 per layer and rank), and DeepSeek's MLA latent (kv_lora_rank + rope channels, no V, whole on every
    rank) instead of its expanded heads."""
    from families import tiny_config

    assert _model(llama70b).kv_bytes_per_token == 80 * 2 * 1 * 128 * 2
    deepseek = tiny_config("deepseek_v3")
    latent_channels = deepseek.kv_lora_rank + deepseek.qk_rope_head_dim
    for tp in (1, 2):
        config = EngineConfig(model=LLAMA70B, dtype="bfloat16", tensor_parallel_size=tp, executor="sim",
                              mla_latent_cache=True)
        assert RooflineStepModel("h100", deepseek, config).kv_bytes_per_token == \
            deepseek.num_hidden_layers * latent_channels * 2
    expanded = RooflineStepModel("h100", deepseek, EngineConfig(model=LLAMA70B, dtype="bfloat16", executor="sim",
                                                                mla_latent_cache=False))
    assert expanded.kv_bytes_per_token > deepseek.num_hidden_layers * latent_channels * 2
