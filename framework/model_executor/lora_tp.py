"""Where one tensor-parallel rank's LoRA slots sit in an adapter's full A and B (vLLM's
``ColumnParallelLinearWithLoRA`` / ``RowParallelLinearWithLoRA``, ``vllm/lora/layers``).

A column-parallel linear holds a slice of the output features: its LoRA slots hold B's matching rows and all of A
(the shrink ``x A^T`` is computed whole on every rank, the expand only for the rank's outputs; no communication).
A row-parallel linear holds a slice of the input features and all-reduces its partial output: its slots hold A's
matching columns and all of B, and the LoRA term is added to the partial output before that all-reduce, so the
group sums ``x_shard A_shard^T B^T`` into ``x A^T B^T`` with the base output (one all-reduce, as without LoRA).

The slices come from the same ``shard_model`` plan that sharded the weights, replayed on a ``meta`` model, so a
LoRA slot is always cut like its base weight (KV heads replicated past their count included).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from framework.model_executor.lora_adapter import TARGET_MODULES
from framework.model_executor.parallel_layers import Shard
from framework.model_executor.tensor_parallel import meta_model, shard_model


def lora_shards(hf_config: Any, tp_rank: int, tp_size: int) -> tuple[dict[str, Shard], dict[str, tuple[int, int]]]:
    """Each LoRA-targetable linear's weight shard on rank ``tp_rank`` and its full shape.

    Args:
        hf_config: the model's ``config.json`` (a ``PretrainedConfig``).
        tp_rank, tp_size: this rank and the tensor-parallel group size.

    Returns:
        ``(shards, full_shapes)``: by module name (``model.layers.0.self_attn.q_proj``; a row-parallel wrapper's
        name, not its inner ``.linear``), the base weight's :class:`Shard` (``dim`` 0: output rows, so B's rows;
        1: input columns, so A's columns) and the unsharded ``(in_features, out_features)``.

    Raises:
        ValueError: a targetable linear is packed (fused q/k/v or gate/up): LoRA adapts them one by one.
    """
    model = meta_model(hf_config)
    full = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rpartition(".")[2] in TARGET_MODULES}
    shards: dict[str, Shard] = {}
    for key, (_, shard) in shard_model(model, tp_rank, tp_size, group_name="").items():
        module = key.removesuffix(".weight").removesuffix(".linear")
        if module not in full or not key.endswith(".weight"):
            continue
        if not isinstance(shard, Shard):
            raise ValueError(f"{module} is packed under tensor parallelism; LoRA needs separate projections")
        shards[module] = shard
    return shards, full
