"""The KV memory of a simulated device: bytes per block and the blocks that fit, without building a cache.

Same arithmetic as the real engine's: a block holds, for each of the ``layers_per_block`` layers that share
a block id (all layers, or one KV cache group's worth with sliding windows:
``framework.core.kv_cache_groups``), K and V of ``block_size`` tokens x this rank's KV heads
(``framework.model_executor.tensor_parallel.rank_layout``: ``K / tp``, replicated when ``tp > K``; MLA's one
latent head on every rank: ``shard_layer_specs``) x the cache's head size; a quantized cache (``engine.kv_cache_dtype=int8|fp8_e4m3``) stores one byte per element plus
a float32 scale per (token, KV head), as the ``torch`` backends do. So the allocator's pool, its
preemptions and its prefix-cache evictions are those of the simulated device and model.

Weights and activations (analytic devices): a rank's weights are its share of the model's parameters
(:func:`parameter_counts`) at the quant method's bytes per weight; the activation reserve follows vLLM's
profiling run in spirit (the largest step's hidden states, MLP intermediate and logits), estimated here
rather than measured.
"""

from __future__ import annotations

import math
from typing import Any

from framework.config import EngineConfig
from framework.interfaces import AttentionLayerSpec

KV_SCALE_BYTES = 4  # float32 scale per (token, KV head) of a quantized cache
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: bytes per weight of each quant method's linear layers (None: the model dtype)
QUANT_WEIGHT_BYTES: dict[str, float | None] = {"none": None, "int8_wo": 1.0, "int4_wo": 0.5, "w8a8": 1.0, "fp8": 1.0}


def rank_attention_layers(hf_config: Any, tensor_parallel_size: int,
                          mla_latent_cache: bool = False) -> list[AttentionLayerSpec]:
    """Each layer's attention as one rank holds it (its heads under tensor parallelism; MLA's latent when
    ``mla_latent_cache``, the engine's ``engine.mla_latent_cache``)."""
    from framework.model_executor.model_families import attention_layers
    from framework.model_executor.tensor_parallel import rank_layout, shard_layer_specs

    layers = attention_layers(hf_config, mla_latent_cache)
    if tensor_parallel_size == 1:
        return layers
    return shard_layer_specs(layers, rank_layout(hf_config, 0, tensor_parallel_size))


def kv_element_bytes(config: EngineConfig) -> tuple[int, int]:
    """``(bytes per K/V element, extra bytes per token and KV head)`` of the cache ``config`` asks for."""
    if config.kv_cache_dtype != "auto":
        return 1, KV_SCALE_BYTES
    return DTYPE_BYTES[config.dtype], 0


def kv_cache_bytes_per_block(config: EngineConfig, hf_config: Any, layers_per_block: int) -> int:
    """Bytes of one KV block on one rank: ``2 * layers_per_block * block_size * kv_heads_per_rank *
    (head_size * element_bytes + scale_bytes)`` (what ``AttentionBackend.kv_cache_bytes_per_block`` gives
    for the ``torch`` and ``torch_paged`` layouts, quantized or not); MLA's latent cache has no V (1, not 2). With
    ``pipeline_parallel_size = k`` a rank holds the busiest stage's ``ceil(layers_per_block / k)`` layers."""
    layers = rank_attention_layers(hf_config, config.tensor_parallel_size, config.mla_latent_cache)
    element, extra = kv_element_bytes(config)
    head_size = max(layer.cache_head_size for layer in layers)
    layers_per_block = math.ceil(layers_per_block / config.pipeline_parallel_size)  # a stage caches its layers only
    return (1 if layers[0].latent_kv else 2) * layers_per_block * config.block_size * layers[0].num_kv_heads * (head_size * element + extra)


def parameter_counts(hf_config: Any) -> dict[str, int]:
    """Parameters of a Llama-style decoder from its config: ``embedding`` (``vocab x hidden``), ``lm_head``
    (0 when tied), ``attention`` and ``mlp`` (all layers; MoE: every expert), ``mlp_active_per_token`` (the
    MLP weights one token reads: ``num_experts_per_tok`` experts of a MoE)."""
    h, v, n = hf_config.hidden_size, hf_config.vocab_size, hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    attention = n * (h * heads * head_dim * 2 + h * kv_heads * head_dim * 2)  # q, o; k, v
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
    inner = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    if experts:
        per_expert = 3 * h * inner
        mlp, active = n * (experts * per_expert + h * experts), n * (hf_config.num_experts_per_tok * per_expert)
    else:
        mlp = active = n * 3 * h * hf_config.intermediate_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return {"embedding": v * h, "lm_head": 0 if tied else v * h, "attention": attention, "mlp": mlp,
            "mlp_active_per_token": active}


def weight_bytes_per_rank(config: EngineConfig, hf_config: Any) -> int:
    """A rank's weights: attention and MLP at the quant method's bytes per weight, embedding and LM head in
    the model dtype (quant methods leave them alone), all split over the tensor-parallel ranks and the pipeline
    stages (an even split: the embedding and LM head counted as if spread over the stages)."""
    counts = parameter_counts(hf_config)
    dtype_bytes = DTYPE_BYTES[config.dtype]
    linear = QUANT_WEIGHT_BYTES.get(config.quant) or dtype_bytes
    total = (counts["attention"] + counts["mlp"]) * linear + (counts["embedding"] + counts["lm_head"]) * dtype_bytes
    return int(total / config.tensor_parallel_size / config.pipeline_parallel_size)


def activation_bytes(config: EngineConfig, hf_config: Any) -> int:
    """Estimated peak activations of the largest step on a rank: ``max_num_batched_tokens`` tokens' hidden
    states (4 live copies), MLP intermediate (gate and up, this rank's share) and q/k/v, plus float32 logits
    of ``max_num_seqs`` sampled rows."""
    h, tp = hf_config.hidden_size, config.tensor_parallel_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inner = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    per_token = 4 * h + 2 * inner // tp + 3 * heads * head_dim // tp
    return (config.max_num_batched_tokens * per_token * DTYPE_BYTES[config.dtype]
            + config.max_num_seqs * hf_config.vocab_size * 4)


def device_kv_budget(config: EngineConfig, hf_config: Any, memory_bytes: int, utilization: float) -> int:
    """KV bytes per rank on a device of ``memory_bytes``: ``utilization`` of it (vLLM's
    ``gpu_memory_utilization``) minus the rank's weights and activations.

    Raises:
        ValueError: the weights and activations alone do not fit (names the knobs).
    """
    budget = int(memory_bytes * utilization) - weight_bytes_per_rank(config, hf_config) - activation_bytes(config, hf_config)
    if budget <= 0:
        raise ValueError(f"the simulated device's {memory_bytes / 2**30:.0f} GiB x {utilization} cannot hold this "
                         f"model's weights per rank ({weight_bytes_per_rank(config, hf_config) / 2**30:.1f} GiB) and "
                         "activations; raise parallel.tensor_parallel_size or executor.params.gpu_memory_utilization")
    return budget
