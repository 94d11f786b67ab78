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
        model_config: its config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or
            ``hidden_size``, ``num_hidden_layers``).
        config: the engine config (attention backend and its params, block size, dtype, device,
            ``max_num_seqs``, ``kv_cache_memory_bytes``).
        max_len: longest sequence the drafter must hold, tokens.
        vocab_size: the runner's sampler width (the target's vocabulary).
        num_blocks: pool size; default enough for ``max_num_seqs`` sequences of ``max_len`` tokens,
            capped by ``kv_cache_memory_bytes`` but never below one ``max_len`` sequence.

    Returns:
        ``(kv_allocator, model_runner)``.
    """
    from framework import registry
    from framework.worker.model_runner import ModelRunner
    from framework.worker.sampler import Sampler

    dtype, device = getattr(torch, config.dtype), torch.device(config.device)
    mc = model_config
    head_size = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    backend = registry.create("attention", config.attention, num_heads=mc.num_attention_heads,
                              num_kv_heads=mc.num_key_value_heads, head_size=head_size, scale=head_size ** -0.5,
                              block_size=config.block_size, dtype=dtype, device=device,
                              **config.plugin_params("attention"))
    blocks_per_seq = -(-max_len // config.block_size)
    budget = config.kv_cache_memory_bytes // backend.kv_cache_bytes_per_block(mc.num_hidden_layers)
    num_blocks = num_blocks or max(blocks_per_seq, min(config.max_num_seqs * blocks_per_seq, budget))
    kv = registry.create("kv_allocator", "paged", num_blocks=num_blocks, block_size=config.block_size,
                         enable_prefix_caching=False)
    runner = ModelRunner(model, backend, num_blocks, mc.num_hidden_layers, dtype, device, Sampler(vocab_size))
    return kv, runner
