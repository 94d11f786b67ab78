"""The KV side of drafters that run a model of their own (``draft_model``, ``eagle``).

Such a drafter gets its own attention backend instance (its own head shape), its own paged KV
tensors and ``paged`` block pool (no prefix caching), and a :class:`framework.worker.model_runner.ModelRunner`
whose input preparation flattens its steps like the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from framework.config import EngineConfig


def build_draft_runner(model: torch.nn.Module, model_config: Any, config: EngineConfig, max_len: int,
                       vocab_size: int, num_blocks: int | None = None) -> tuple[Any, Any]:
    """A drafter's block pool and runner.

    Args:
        model: the drafter's module (a ``*ForCausalLM`` or an EAGLE head), on ``config.device``.
        model_config: its transformers config (each layer's attention is read from it by
            ``framework.model_executor.model_families.attention_layers``, as for the target).
        config: the engine config (attention backend and its params, block size, dtype, device,
            ``max_num_seqs``, ``kv_cache_memory_bytes``).
        max_len: longest sequence the drafter must hold, tokens.
        vocab_size: the runner's sampler width (the target's vocabulary).
        num_blocks: pool size; default enough for ``max_num_seqs`` sequences of ``max_len`` tokens,
            capped by ``kv_cache_memory_bytes`` but never below one ``max_len`` sequence.

    Returns:
        ``(kv_allocator, model_runner)``.

    Raises:
        ValueError: the attention backend cannot run the drafter's layers (or the architecture is
            refused: ``UnsupportedModelError``).
    """
    from framework import registry
    from framework.model_executor.model_families import attention_layers
    from framework.sample.sampler import Sampler
    from framework.worker.model_runner import ModelRunner

    dtype, device = getattr(torch, config.dtype), torch.device(config.device)
    mc = model_config
    layers = attention_layers(mc)
    problems = registry.get_class("attention", config.attention).validate_model(layers, config)
    if problems:
        raise ValueError("the drafter's model: " + "; ".join(problems))
    head_size = max(layer.cache_head_size for layer in layers)
    scale = next((float(m.scaling) for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")),
                 layers[0].head_size ** -0.5)
    backend = registry.create("attention", config.attention, num_heads=layers[0].num_heads,
                              num_kv_heads=layers[0].num_kv_heads, head_size=head_size, scale=scale,
                              block_size=config.block_size, dtype=dtype, device=device, layers=layers,
                              **config.plugin_params("attention"))
    blocks_per_seq = -(-max_len // config.block_size)
    budget = config.kv_cache_memory_bytes // backend.kv_cache_bytes_per_block(mc.num_hidden_layers)
    num_blocks = num_blocks or max(blocks_per_seq, min(config.max_num_seqs * blocks_per_seq, budget))
    kv = registry.create("kv_allocator", "paged", num_blocks=num_blocks, block_size=config.block_size,
                         enable_prefix_caching=False)
    runner = ModelRunner(model, backend, num_blocks, mc.num_hidden_layers, dtype, device, Sampler(vocab_size))
    return kv, runner
