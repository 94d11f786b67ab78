"""DeepSeek's MLA under tensor parallelism: the DeepSeek plan of ``framework/model_executor/tensor_parallel.py``
(heads split, the latent replicated, as vLLM's DeepseekV2MLAAttention) and ``shard_layer_specs`` (one latent
KV head per rank).

Tiny DeepSeek-V2 (no q LoRA) and V3 (q LoRA, grouped sigmoid router) models served at
``tensor_parallel_size=2`` (``executor=mp``, float32, chunked prefill and preemption forced by
``tests/families.py``'s engine) give transformers' greedy tokens, with prefix-cache hits and without prefix
caching; a rank's KV block holds the whole latent, as a single-rank engine's does; a head count the size does not
divide is refused before any worker starts, naming the sizes that work.
"""

from __future__ import annotations

import pytest
from families import ENGINE, assert_matches_transformers, run_family, tiny_config, tiny_model_dir
from torch import nn

from framework import EngineConfig
from framework.model_executor.model_families import attention_layers
from framework.model_executor.parallel_layers import Shard
from framework.model_executor.tensor_parallel import (
    meta_model,
    rank_layout,
    shard_layer_specs,
    shard_model,
    tp_problems,
)

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
TORCH_PAGED = dict(attention="torch_paged", prepack_linears="on", attention_params={"compile": False})


def latent_bytes_per_block(family: str) -> int:
    """``(kv_lora_rank + qk_rope_head_dim) * 4 bytes * num_layers * block_size``: float32, the whole latent."""
    c = tiny_config(family)
    return (c.kv_lora_rank + c.qk_rope_head_dim) * 4 * c.num_hidden_layers * ENGINE["block_size"]


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_plan_splits_heads_and_replicates_the_latent(family: str) -> None:
    """Rank 1 of 2 holds heads 2-3: their rows of the query and ``kv_b_proj`` up-projections and their
    ``o_proj`` columns; the latent's down-projection stays whole; experts, shared experts and the dense
    MLP split as the MoE and Llama plans do."""
    c = tiny_config(family)
    model = meta_model(c)
    sources = shard_model(model, 1, 2, group_name="")
    attn = model.model.layers[1].self_attn
    query = attn.q_proj if c.q_lora_rank is None else attn.q_b_proj
    kv_rows = c.qk_nope_head_dim + c.v_head_dim
    assert query.out_features == 2 * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    assert tuple(attn.kv_b_proj.weight.shape) == (2 * kv_rows, c.kv_lora_rank)
    assert sources["model.layers.1.self_attn.kv_b_proj.weight"] == ("model.layers.1.self_attn.kv_b_proj.weight",
                                                                    Shard(0, 2 * kv_rows, 4 * kv_rows, 2 * kv_rows))
    assert type(attn.o_proj).__name__ == "RowParallelLinear" and attn.o_proj.linear.in_features == 2 * c.v_head_dim
    assert type(attn.kv_a_proj_with_mqa) is nn.Linear
    assert attn.kv_a_proj_with_mqa.out_features == c.kv_lora_rank + c.qk_rope_head_dim
    if c.q_lora_rank is not None:
        assert type(attn.q_a_proj) is nn.Linear and attn.q_a_proj.out_features == c.q_lora_rank
    assert (attn.num_heads, attn.num_key_value_groups) == (2, 1)
    moe = model.model.layers[1].mlp
    assert type(moe.experts).__name__ == "RowParallelExperts"
    assert type(moe.shared_experts.down_proj).__name__ == "RowParallelLinear"
    assert model.model.layers[0].mlp.gate_proj.out_features == c.intermediate_size // 2


def test_rank_specs_keep_one_latent_head() -> None:
    """A rank's latent layers attend with its query heads over the one replicated latent head; the expanded
    cache (``mla_latent_cache=false``) splits K/V with the heads."""
    c = tiny_config("deepseek_v3")
    layout = rank_layout(c, 1, 2)
    latent = shard_layer_specs(attention_layers(c, mla_latent_cache=True), layout)
    expanded = shard_layer_specs(attention_layers(c, mla_latent_cache=False), layout)
    assert {(x.num_heads, x.num_kv_heads, x.head_size, x.value_head_size, x.latent_kv) for x in latent} == \
        {(2, 1, 24, 16, True)}
    assert {(x.num_heads, x.num_kv_heads, x.head_size, x.value_head_size, x.latent_kv) for x in expanded} == \
        {(2, 2, 24, 12, False)}


@pytest.mark.parametrize(("latent", "tp", "factor"), [(True, 1, 1), (True, 2, 1), (True, 4, 1),
                                                      (False, 1, 8), (False, 2, 4), (False, 4, 2)])
def test_simulated_kv_block_per_rank(latent: bool, tp: int, factor: int) -> None:
    """``executor=sim``'s KV pool: a rank's latent block is the whole latent at any TP size; the expanded
    cache's shrinks with the heads."""
    from framework.sim.memory import kv_cache_bytes_per_block

    c = tiny_config("deepseek_v3")
    config = EngineConfig(model="m", dtype="float32", block_size=ENGINE["block_size"], mla_latent_cache=latent,
                          tensor_parallel_size=tp)
    assert kv_cache_bytes_per_block(config, c, c.num_hidden_layers) == factor * latent_bytes_per_block("deepseek_v3")


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_heads_the_size_cannot_split_are_refused(make_llm, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """4 heads over 3 ranks: refused from the config before any worker starts, naming the valid sizes."""
    from framework.engine import builder

    def no_executor(*args, **kwargs):
        raise AssertionError("an executor was started for a refused model")

    assert tp_problems(tiny_config(family), 2) == []
    monkeypatch.setattr(builder, "make_executor", no_executor)
    with pytest.raises(ValueError) as err:
        make_llm(model=str(tiny_model_dir(family)), tensor_parallel_size=3, executor="mp", dtype="float32")
    assert "num_attention_heads=4 is not divisible by tensor_parallel_size=3" in str(err.value)
    assert f"valid tensor_parallel_size values for {type(meta_model(tiny_config(family))).__name__}: [1, 2, 4]" \
        in str(err.value)


def _served_tp2(make_llm, family: str, **overrides) -> object:
    """The family's tiny model at TP=2 under the parity engine: equal to transformers token for token (and
    top-5 log-probabilities within 1e-4), preempted and chunked; the LLM."""
    llm, outs = run_family(make_llm, family, tensor_parallel_size=2, executor="mp", **overrides)
    assert_matches_transformers(family, outs, f"tensor_parallel_size=2, {overrides}")
    summary = llm.engine.metrics.summary()
    assert summary["num_preemptions"] > 0, summary
    return llm


@pytest.mark.parametrize(("family", "backend"), [("deepseek_v2", dict(attention="torch")),
                                                 ("deepseek_v3", TORCH_PAGED)])
def test_tp2_latent_cache_with_prefix_hits_matches_transformers(make_llm, family: str, backend: dict) -> None:
    """Prefix-cache hits on the shared prompt prefix; each rank's KV block holds exactly the whole latent."""
    llm = _served_tp2(make_llm, family, **backend)
    assert llm.engine.kv_allocator.stats().hit_rate > 0.2
    assert llm.engine.metrics.kv_cache_info["kv_cache_bytes_per_block"] == latent_bytes_per_block(family)


@pytest.mark.slow
def test_tp2_latent_cache_without_prefix_caching_matches_transformers(make_llm) -> None:
    """``enable_prefix_caching=false``: every prompt computed in full, no hit (DeepSeek-V2; V3 runs it in
    ``test_tp2_expanded_cache_matches_transformers``: the model's differences do not meet the allocator's)."""
    llm = _served_tp2(make_llm, "deepseek_v2", attention="torch", enable_prefix_caching=False)
    assert llm.engine.kv_allocator.stats().hit_rate == 0


@pytest.mark.slow
def test_tp2_expanded_cache_matches_transformers(make_llm) -> None:
    """``mla_latent_cache=false`` at TP=2: K/V expanded for the rank's 2 heads, half the single rank's block;
    without prefix caching (no hit), one engine for both."""
    llm = _served_tp2(make_llm, "deepseek_v3", attention="torch", mla_latent_cache=False, enable_prefix_caching=False)
    assert llm.engine.metrics.kv_cache_info["kv_cache_bytes_per_block"] == 4 * latent_bytes_per_block("deepseek_v3")
    assert llm.engine.kv_allocator.stats().hit_rate == 0


@pytest.mark.slow
def test_tp2_compiled_latent_cache_matches_transformers(make_llm) -> None:
    """``engine.compile=true`` at TP=2: each rank traces its heads' absorption into the layer graphs, attention
    stays the opaque op (about four minutes of inductor on 2 cores)."""
    _served_tp2(make_llm, "deepseek_v3", attention="torch", compile="true")
