"""DeepSeek's MLA over a latent KV cache (``framework/model_executor/mla.py``, ``engine.mla_latent_cache``).

Tiny DeepSeek-V2 (no q LoRA, complex RoPE) and V3 (q LoRA) models equal transformers token for token
with chunked prefill, prefix hits and preemption forced (``tests/families.py``'s engine); a KV block
costs exactly the latent's bytes; at one KV budget more sequences fit than with the expanded cache;
what the latent cache is not built with is refused, naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from families import ENGINE, MAX_TOKENS, assert_matches_transformers, run_family, tiny_config

from framework import EngineConfig, registry
from framework.interfaces import AttentionLayerSpec
from framework.model_executor.model_families import attention_layers
from plugins.attention.torch import TorchAttentionBackend

BACKENDS = {
    "torch": dict(attention="torch"),
    "torch_paged": dict(attention="torch_paged", prepack_linears="on", attention_params={"compile": False}),
}


def latent_bytes_per_block(family: str, dtype_bytes: int = 4) -> int:
    """The latent formula: ``(kv_lora_rank + qk_rope_head_dim) * dtype bytes * num_layers`` per token."""
    c = tiny_config(family)
    return (c.kv_lora_rank + c.qk_rope_head_dim) * dtype_bytes * c.num_hidden_layers * ENGINE["block_size"]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_cache_matches_transformers(family, backend, make_llm):
    """DeepSeek-V2 on ``torch`` also preempts by swapping (``preemption_mode=swap``): ``copy_blocks`` moves the
    one latent tensor per layer out and back."""
    swap = dict(preemption_mode="swap", swap_space_bytes=64 * latent_bytes_per_block(family)) \
        if (family, backend) == ("deepseek_v2", "torch") else {}
    llm, outs = run_family(make_llm, family, **BACKENDS[backend], **swap)
    assert_matches_transformers(family, outs, f"latent cache, {backend}{', swap' if swap else ''}")
    summary = llm.engine.metrics.summary()
    assert summary["num_preemptions"] > 0 and llm.engine.kv_allocator.stats().hit_rate > 0.2, summary
    if swap:
        assert summary["num_preemptions_swap"] > 0 and summary["num_swap_in_blocks"] > 0, summary
    assert summary["num_steps"] > MAX_TOKENS + 2  # prompts were chunked
    assert llm.engine.metrics.kv_cache_info["kv_cache_bytes_per_block"] == latent_bytes_per_block(family)


def test_ablation_switch_gives_the_expanded_cache(make_llm):
    """``mla_latent_cache=false`` caches K and V per head (padded to the key head size): 2 x 4 heads x 24."""
    llm, outs = run_family(make_llm, "deepseek_v3", attention="torch", mla_latent_cache=False)
    assert_matches_transformers("deepseek_v3", outs, "expanded cache")
    c = tiny_config("deepseek_v3")
    expanded = 2 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) * 4 * c.num_hidden_layers * 4
    assert llm.engine.metrics.kv_cache_info["kv_cache_bytes_per_block"] == expanded
    assert expanded == 8 * latent_bytes_per_block("deepseek_v3")


def test_more_sequences_fit_one_kv_budget(make_llm):
    """At a fixed ``kv_cache_memory_bytes`` the latent cache holds 8x the blocks, so 8x the sequences of
    ``max_model_len`` tokens (2 -> 16 here) run at once."""
    from families import tiny_model_dir

    budget = 2 * 16 * 9216  # two 64-token sequences of the expanded cache (16 blocks of 9216 bytes each)
    fits = {}
    for latent in (True, False):
        llm = make_llm(model=str(tiny_model_dir("deepseek_v3")), **{**ENGINE, "num_blocks": None},
                       kv_cache_memory_bytes=budget, mla_latent_cache=latent, attention="torch")
        fits[latent] = llm.engine.scheduler.kv.num_blocks // (ENGINE["max_model_len"] // ENGINE["block_size"])
    assert fits == {True: 16, False: 2}


def test_latent_layer_spec():
    layers = attention_layers(tiny_config("deepseek_v2"), mla_latent_cache=True)
    assert {(x.num_heads, x.num_kv_heads, x.head_size, x.value_head_size, x.latent_kv) for x in layers} == \
        {(4, 1, 24, 16, True)}
    assert not any(x.latent_kv for x in attention_layers(tiny_config("llama"), mla_latent_cache=True))


def test_torch_backend_stores_only_the_latent():
    """One cache tensor ``(1, num_blocks, block_size, 1, rank + rope)``; V is read back as K."""
    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=1, head_size=24, value_head_size=16, latent_kv=True)
    backend = TorchAttentionBackend(4, 1, 24, 0.2, 4, torch.float32, torch.device("cpu"), [spec, spec])
    cache = torch.zeros(backend.get_kv_cache_shape(3))
    assert cache.shape == (1, 3, 4, 1, 24)
    assert backend.kv_cache_bytes_per_block(2) == 24 * 4 * 4 * 2
    key = torch.randn(2, 1, 24)
    backend.write_kv(cache, key, torch.zeros(2, 1, 24), torch.tensor([5, 6]))
    k, v = backend.read_kv(cache, torch.tensor([5, 6]))
    assert torch.equal(k, key) and torch.equal(v, key)


def test_refusals_name_the_fix():
    layers = attention_layers(tiny_config("deepseek_v3"), mla_latent_cache=True)
    triton = registry.get_class("attention", "triton").validate_model(layers)
    assert any("MLA latent KV cache" in p and "mla_latent_cache=false" in p for p in triton)
    for knob in (dict(kv_cache_dtype="int8"), dict(quant="int8_wo")):
        problems = registry.get_class("attention", "torch").validate_model(layers, EngineConfig(model="m", **knob))
        assert len(problems) == 1 and "mla_latent_cache=false" in problems[0], (knob, problems)
    assert not registry.get_class("attention", "torch").validate_model(layers, EngineConfig(model="m"))


@pytest.mark.slow
def test_compiled_latent_cache_matches_transformers(make_llm):
    """``engine.compile=true``: the absorption is traced into the layer graphs, attention stays the opaque op
    (about three minutes of inductor on 2 cores)."""
    llm, outs = run_family(make_llm, "deepseek_v3", attention="torch", compile="true")
    assert_matches_transformers("deepseek_v3", outs, "latent cache, compiled")
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


def test_simulator_prices_the_latent_block():
    """``executor=sim`` sizes a block as the engine does, latent or expanded."""
    from framework.sim.memory import kv_cache_bytes_per_block

    c = tiny_config("deepseek_v3")
    for latent, factor in ((True, 1), (False, 8)):
        config = EngineConfig(model="m", dtype="float32", block_size=ENGINE["block_size"], mla_latent_cache=latent)
        assert kv_cache_bytes_per_block(config, c, c.num_hidden_layers) == factor * latent_bytes_per_block("deepseek_v3")


def test_kv_memory_experiment_reports_the_latent_formula():
    """``experiments/engine/kv_memory_mla.py``: the backend's bytes equal the formula for the published dims."""
    import sys

    from helpers import REPO

    sys.path.insert(0, str(REPO))
    from experiments.engine import kv_memory_mla

    results = kv_memory_mla.main([])
    assert results == {"DeepSeek-V2-Lite": (576 * 2 * 27, 2 * 16 * 192 * 2 * 27),
                       "DeepSeek-V3": (576 * 2 * 61, 2 * 128 * 192 * 2 * 61)}


@pytest.mark.parametrize("name", ["torch", "torch_paged"])
def test_latent_backends_pass_the_conformance_suite(name):
    """``servelab.testing``'s suite with ``latent=True``: random mixed batches equal naive attention with V = K."""
    from framework.testing.attention import check_attention_backend

    params = {"compile": False} if name == "torch_paged" else {}
    check_attention_backend(registry.get_class("attention", name), num_batches=8, head_size=12, latent=True, **params)
