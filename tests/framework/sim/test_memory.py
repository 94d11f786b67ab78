"""The simulator's KV memory model against the real engine's allocator: same bytes per block, same blocks."""

from __future__ import annotations

import pytest
from families import tiny_model_dir
from helpers import REPO, STORIES
from sim_helpers import linear_profile

from framework import build_engine
from framework.config import EngineConfig
from framework.model_executor.model_loader import load_model_config
from framework.sim.memory import device_kv_budget, parameter_counts, weight_bytes_per_rank

LLAMA70B = str(REPO / "models" / "llama-3-70b")


def _blocks(config: EngineConfig) -> tuple[int, int, int]:
    engine = build_engine(config)
    try:
        info = engine.metrics.kv_cache_info
        return engine.scheduler.kv.num_blocks, info["kv_cache_bytes_per_block"], info["kv_cache_layers_per_block"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model, knobs", [
    ("smollm2", {}),  # bfloat16 (dtype auto), 30 layers x 3 KV heads x 64
    ("smollm2", {"kv_cache_dtype": "int8", "block_size": 32}),  # one byte + a float32 scale per (token, head)
    ("smollm2", {"dtype": "float32", "attention": "torch"}),
    (STORIES, {"kv_cache_memory_bytes": 1 << 20}),
    ("gemma3", {}),  # sliding-window KV cache groups: several layers' pages share a block id
])
def test_block_counts_equal_the_real_allocators(model, knobs, tmp_path):
    path = str(tiny_model_dir(model)) if model == "gemma3" else model
    base = {"kv_cache_memory_bytes": 48 << 20, "max_model_len": 256, **knobs}
    if "attention" not in knobs:  # torch_paged: counting blocks needs no start-up compile of its kernel
        base["attention_params"] = {"compile": False}
    real = _blocks(EngineConfig(model=path, compile=False, **base))
    sim = _blocks(EngineConfig(model=path, compile=False, executor="sim",
                               executor_params={"profile": linear_profile(tmp_path / "p.json")}, **base))
    assert sim == real


def test_tensor_parallel_ranks_hold_their_share_of_the_heads(tmp_path):
    def per_block(tp: int) -> int:
        engine = build_engine(EngineConfig(model="smollm2", compile=False, executor="sim", tensor_parallel_size=tp,
                                           max_model_len=1024,
                                           executor_params={"profile": linear_profile(tmp_path / "p.json")}))
        try:
            return engine.metrics.kv_cache_info["kv_cache_bytes_per_block"]
        finally:
            engine.shutdown()

    assert per_block(3) * 3 == per_block(1)  # 3 KV heads over 3 ranks: one each


def test_llama3_70b_on_h100_budget():
    hf = load_model_config(LLAMA70B)
    assert 70.0e9 < sum(v for k, v in parameter_counts(hf).items() if k != "mlp_active_per_token") < 71.0e9
    config = EngineConfig(model=LLAMA70B, dtype="bfloat16", tensor_parallel_size=8, executor="sim")
    assert weight_bytes_per_rank(config, hf) == pytest.approx(70.55e9 * 2 / 8, rel=0.01)
    budget = device_kv_budget(config, hf, 80 * 10**9, 0.9)
    assert 50e9 < budget < 55e9  # 72 GB usable - 17.6 GB of weights - activations
    with pytest.raises(ValueError, match="raise parallel.tensor_parallel_size"):
        device_kv_budget(EngineConfig(model=LLAMA70B, dtype="bfloat16", executor="sim"), hf, 80 * 10**9, 0.9)
