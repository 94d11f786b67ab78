"""A pre-quantized checkpoint layer's tensor-parallel shard: which checkpoint layer a rank's linear comes from,
and the slice of its unpacked integer weight that rank keeps.

Under ``tensor_parallel_size > 1`` the model is built on ``meta`` and sharded by its plan
(``framework/model_executor/tensor_parallel.py``); the rank's linears hold a slice of their layer, described by
the model's ``tp_weight_sources`` (``framework/model_executor/tp_weights.py``: param name -> (checkpoint
tensor, :class:`~framework.model_executor.parallel_layers.Shard` or ``PackedShard``)). Each rank unpacks the
layer's packed tensors (read from the memory-mapped file) to :class:`IntWeights` and keeps its slice, as
vLLM's GPTQ/AWQ/compressed-tensors loaders do with their ``weight_loader``s:

- column-parallel (``Shard`` along dim 0, the output features; ``PackedShard`` for fused projections): codes,
  zero points, scales and bias rows — AWQ and compressed-tensors zero points are packed along the output
  dimension, so slicing after unpacking is what respects their packing;
- row-parallel (dim 1, the input features): codes columns and their ``g_idx``, in whole groups; a shard
  boundary inside a group is refused (the layer, ``group_size`` and ``tensor_parallel_size`` named). With
  act-order (``g_idx`` not ``i // group_size``, GPTQ ``desc_act``) or one group per row, scales and zero points
  stay whole on every rank and each keeps the ``g_idx`` of its own input columns: vLLM ``gptq.py``
  ``create_weights`` (``scale_and_zero_input_dim = None`` when ``desc_act`` and the input is partitioned).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from framework.model_executor.parallel_layers import PackedShard, Shard
from plugins.quant._checkpoint_linears import IntWeights
from plugins.quant._input_quant import Fp8Weights

Weights = IntWeights | Fp8Weights


def checkpoint_layer(name: str, sources: dict[str, tuple[str, Any]] | None, full: torch.nn.Module,
                     ) -> tuple[str, Shard | PackedShard | None]:
    """The checkpoint layer rank-local linear ``name`` comes from, and its slice of that layer's weight
    (None: whole). ``sources``: the model's ``tp_weight_sources`` (None at TP=1); ``full``: the unsharded
    model on ``meta`` (a wrapper's inner ``<layer>.linear`` is the checkpoint's ``<layer>``)."""
    if sources is not None and f"{name}.weight" in sources:
        key, shard = sources[f"{name}.weight"]
        return key.removesuffix(".weight"), shard
    outer = name.removesuffix(".linear")
    if outer != name and not _has_module(full, name) and _has_module(full, outer):
        return outer, None
    return name, None


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _rows(t: torch.Tensor | None, shard: Shard | PackedShard) -> torch.Tensor | None:
    """Rows (dim 0) of ``t`` the column shard holds (a ``PackedShard``: its sections concatenated)."""
    if t is None:
        return None
    sections = shard.sections if isinstance(shard, PackedShard) else (shard,)
    return torch.cat([t[s.start:s.stop] for s in sections]).contiguous()


def shard_weights(w: Weights, shard: Shard | PackedShard, layer: str, tp_size: int) -> Weights:
    """This rank's slice of layer ``layer``'s unpacked weight ``w`` (see the module docstring).

    Args:
        w: the whole layer (``(out, in)`` codes or float8 weight).
        shard: along dim 0 (column-parallel, bias sliced too) or dim 1 (row-parallel: the bias is dropped,
            ``RowParallelLinear`` adds the checkpoint's bias once after the all-reduce).
        layer, tp_size: named in errors.

    Raises:
        ValueError: a padded shard (only vocabularies are padded), or a row shard splitting a group.
    """
    sections = shard.sections if isinstance(shard, PackedShard) else (shard,)
    if any(s.size != s.stop - s.start for s in sections):
        raise ValueError(f"{layer}: a padded tensor-parallel shard of a quantized layer (tensor_parallel_size="
                         f"{tp_size}); only vocabulary-parallel layers are padded")
    if shard.dim == 0:
        if isinstance(w, Fp8Weights):
            return dataclasses.replace(w, weight=_rows(w.weight, shard), scales=_rows(w.scales, shard),
                                       bias=_rows(w.bias, shard))
        return dataclasses.replace(w, codes=_rows(w.codes, shard), zeros=_rows(w.zeros, shard),
                                   scales=_rows(w.scales, shard), bias=_rows(w.bias, shard))
    start, stop = shard.start, shard.stop
    if isinstance(w, Fp8Weights):  # per-channel or per-tensor scales: whole on every rank
        return dataclasses.replace(w, weight=w.weight[:, start:stop].contiguous(), bias=None)
    return _input_shard(w, start, stop, layer, tp_size)


def _input_shard(w: IntWeights, start: int, stop: int, layer: str, tp_size: int) -> IntWeights:
    """Input columns ``[start, stop)`` of ``w``, in whole groups (or with scales kept whole, see the module)."""
    in_f, groups = w.codes.shape[1], w.scales.shape[1]
    codes, g_idx = w.codes[:, start:stop].contiguous(), w.g_idx[start:stop]
    in_order = torch.equal(w.g_idx, torch.arange(in_f) * groups // in_f)
    if groups == 1 or not in_order:  # one group per row, or act-order: scales and zeros stay whole
        return dataclasses.replace(w, codes=codes, g_idx=g_idx.clone(), bias=None)
    group_size = in_f // groups
    if start % group_size or stop % group_size:
        raise ValueError(f"{layer}: tensor_parallel_size={tp_size} gives a rank input features [{start}, {stop}), "
                         f"which splits a group of group_size={group_size}; use a tensor_parallel_size whose "
                         f"row-parallel shards are multiples of {group_size}, or a checkpoint with a smaller group_size")
    first, last = start // group_size, stop // group_size
    return dataclasses.replace(w, codes=codes, g_idx=(g_idx - first).contiguous(),
                               zeros=w.zeros[:, first:last].contiguous(),
                               scales=w.scales[:, first:last].contiguous(), bias=None)


def row_split_problems(method: str, group_sizes: list[int], full: dict[str, tuple[int, int]],
                       local: dict[str, tuple[int, int]], tp_size: int) -> list[str]:
    """Before weights load: the row-parallel layers (``local`` in_features below ``full``'s) whose per-rank
    ``in_features`` a group size of the file does not divide, where the full layer's does (a layer it cannot
    group is not quantized by the file). ``full``/``local``: ``linear_shapes`` at TP=1 and ``tp_size``."""
    problems = []
    for name, (in_f, _) in local.items():
        full_in = full.get(name, (in_f, 0))[0]
        for group in group_sizes:
            if group > 0 and in_f < full_in and not full_in % group and in_f % group:
                problems.append(f"quant={method} with tensor_parallel_size={tp_size}: {name} (row-parallel) holds "
                                f"in_features={in_f} per rank, which splits its groups of group_size={group}; use a "
                                f"tensor_parallel_size whose shard is a multiple of {group}, or a checkpoint with a "
                                "smaller group_size")
    return problems
