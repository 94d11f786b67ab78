"""Tensor-parallel layers that replace a transformers model's ``nn.Linear`` / ``nn.Embedding`` leaves.

Megatron-LM's split (Shoeybi et al., 2019, Sec. 3): a column-parallel linear holds a slice of the
output features and needs no communication (its input is replicated, its output stays sharded); the
row-parallel linear after it holds the matching slice of the input features and all-reduces its
partial output. One attention block and one MLP therefore cost one all-reduce each.

* ``colwise`` needs no class: the layer stays a plain ``nn.Linear`` holding its rows (as vLLM's
  ``ColumnParallelLinear`` with ``gather_output=False`` is a plain local GEMM), so prepacking,
  projection fusion and the quant methods see an ordinary, smaller linear.
* :class:`RowParallelLinear` (``rowwise``): an inner ``nn.Linear`` shard without bias, then an
  all-reduce, then the bias once.
* :class:`GatheredColumnParallelLinear` (``colwise_rep`` / ``colwise_gather_output`` on a layer
  that is not the LM head): an inner shard, then an all-gather along the features.
* :class:`VocabParallelEmbedding`: a slice of the vocabulary; masked lookup, then an all-reduce.
* :class:`ParallelLMHead`: a slice of the vocabulary (the embedding's slice when tied); logits are
  gathered to the driver rank only.
* :class:`RowParallelExperts` (``moe_tp_experts``): a MoE block's fused experts, each holding a slice
  of its intermediate features (``gate_up_proj`` packed column-parallel, ``down_proj`` row-parallel),
  then one all-reduce of the weighted sum (vLLM's ``FusedMoE`` without expert parallelism).
* :class:`ShardedRMSNorm`: an RMSNorm over the FULL width of a head-sharded projection (OLMo 2's
  and OLMoE's q/k norm): one all-reduce of each token's sum of squares.

Each layer holds its group's ``group_name`` (the TP group of
:mod:`framework.distributed.parallel_state`, passed in by ``tensor_parallel.shard_model``) and calls
the collectives of :mod:`framework.distributed.communication_op` with it, which go through the
group's communicator (torch.distributed's functional collectives, or the shared-memory one behind
opaque custom ops); either way a compiled decoder keeps its collectives inside the graph
(``fullgraph`` holds). Those collectives (``all_reduce``, ``all_gather_last_dim``,
``gather_last_dim_to_driver``, ``set_communicator``) are importable from here too, as before the
move. The inner ``nn.Linear`` of a wrapper is the attribute ``linear``: quant methods and
prepacking replace it and the communication around it stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.distributed.communication_op import (
    DRIVER_RANK,
    all_gather_last_dim,
    all_reduce,
    gather_last_dim_to_driver,
)


@dataclass(frozen=True)
class Shard:
    """Which part of a checkpoint tensor one rank holds (``[start, stop)`` along ``dim``).

    ``size`` is the local length along ``dim``; it exceeds ``stop - start`` on the last rank of a
    padded vocabulary, where the extra rows are zeros.
    """

    dim: int  # 0: output features / vocabulary rows; 1: input features
    start: int  # first index held, in the full tensor
    stop: int  # one past the last index held
    size: int  # local length along dim (>= stop - start)


@dataclass(frozen=True)
class PackedShard:
    """Several slices of one checkpoint tensor, concatenated along their common ``dim``: a packed
    projection's sections (``gate_up_proj``: this rank's gate rows, then its up rows; Phi-3's
    ``qkv_proj``: its query, key and value heads), as vLLM's ``MergedColumnParallelLinear`` /
    ``QKVParallelLinear`` load them."""

    sections: tuple[Shard, ...]  # in the order they are concatenated; all along the same dim

    @property
    def dim(self) -> int:
        """The dimension the sections are taken and concatenated along."""
        return self.sections[0].dim

    @property
    def size(self) -> int:
        """Local length along ``dim`` (the sections' sizes summed)."""
        return sum(s.size for s in self.sections)


def even_range(total: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``tp_rank`` when ``total`` (divisible by ``tp_size``) is split evenly."""
    per = total // tp_size
    return tp_rank * per, (tp_rank + 1) * per


def padded_range(total: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """``(start, stop, size)`` for a split that need not divide: every rank gets ``ceil(total / tp)``
    slots, the last ones hold fewer real rows (vLLM pads the vocabulary the same way)."""
    size = -(-total // tp_size)
    start = min(tp_rank * size, total)
    return start, min(start + size, total), size


def _empty_weight(out_features: int, in_features: int, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(out_features, in_features, dtype=like.dtype, device=like.device),
                        requires_grad=False)


class RowParallelLinear(nn.Module):
    """``rowwise``: ``y = all_reduce(x_shard @ W[:, shard].T) + b``.

    Args:
        in_features: the FULL input width; this rank holds ``in_features / tp_size`` of it.
        out_features: output width (replicated).
        bias: whether the full layer has a bias (replicated, added once after the sum: adding it in
            every rank's partial product would count it ``tp_size`` times).
        tp_rank, tp_size: this rank and the group size.
        group_name: the TP process group's name (``ProcessGroup.group_name``).
        like: a tensor whose dtype and device (``meta`` while the model is built) the new
            parameters take.

    ``forward``: ``x (..., in_features / tp_size)`` -> ``(..., out_features)``, same dtype; one
    all-reduce of ``out_features`` elements per token.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int,
                 group_name: str, like: torch.Tensor) -> None:
        super().__init__()
        start, stop = even_range(in_features, tp_rank, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.shard = Shard(1, start, stop, stop - start)
        self.group_name = group_name
        self.linear = nn.Linear(stop - start, out_features, bias=False, device="meta")
        self.linear.weight = _empty_weight(out_features, stop - start, like)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=like.dtype, device=like.device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        out = all_reduce(self.linear(x), self.group_name)
        return out if self.bias is None else out + self.bias


class GatheredColumnParallelLinear(nn.Module):
    """``colwise_rep`` / ``colwise_gather_output``: ``y = all_gather(x @ W[shard].T + b[shard])``.

    Args: as :class:`RowParallelLinear`, with ``out_features`` (FULL, divisible by ``tp_size``) split.

    ``forward``: ``x (..., in_features)`` -> ``(..., out_features)`` on every rank; one all-gather
    of ``out_features`` elements per token.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int,
                 group_name: str, like: torch.Tensor) -> None:
        super().__init__()
        start, stop = even_range(out_features, tp_rank, tp_size)
        self.in_features, self.out_features = in_features, out_features
        self.shard = Shard(0, start, stop, stop - start)
        self.group_name = group_name
        self.linear = nn.Linear(in_features, stop - start, bias=False, device="meta")
        self.linear.weight = _empty_weight(stop - start, in_features, like)
        if bias:
            self.linear.bias = nn.Parameter(torch.empty(stop - start, dtype=like.dtype, device=like.device),
                                            requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        return all_gather_last_dim(self.linear(x), self.group_name)


class VocabParallelEmbedding(nn.Module):
    """Input embedding holding vocabulary rows ``[start, stop)`` (padded to ``ceil(vocab / tp)``).

    Args:
        num_embeddings: FULL vocabulary size; embedding_dim: hidden size.
        tp_rank, tp_size, group_name, like: as :class:`RowParallelLinear`.
        scale: multiplies the looked-up rows (Gemma's ``*ScaledWordEmbedding``: ``sqrt(hidden)``, cast
            to the weight's dtype first as transformers does); applied after the all-reduce, which
            is exact since the other ranks add zeros.

    ``forward``: ``ids (...,)`` int64 -> ``(..., embedding_dim)``: each rank looks up the ids it
    holds (zeros for the others), then one all-reduce of ``embedding_dim`` elements per token.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int, tp_size: int, group_name: str,
                 like: torch.Tensor, scale: float | None = None) -> None:
        super().__init__()
        start, stop, size = padded_range(num_embeddings, tp_rank, tp_size)
        self.num_embeddings, self.embedding_dim, self.scale = num_embeddings, embedding_dim, scale
        self.shard = Shard(0, start, stop, size)
        self.group_name = group_name
        self.weight = _empty_weight(size, embedding_dim, like)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        local = input_ids - self.shard.start
        held = (local >= 0) & (input_ids < self.shard.stop)
        out = nn.functional.embedding(local.masked_fill(~held, 0), self.weight)
        out = all_reduce(out.masked_fill(~held[..., None], 0), self.group_name)
        if self.scale is None:
            return out
        return out * torch.tensor(self.scale, dtype=torch.float32, device=out.device).to(out.dtype)


class ParallelLMHead(nn.Module):
    """LM head over a vocabulary slice; the full logits are gathered to the driver rank only.

    Args:
        in_features: hidden size; vocab_size: FULL vocabulary size.
        tp_rank, tp_size, group_name, like: as :class:`RowParallelLinear`.
        tied: the :class:`VocabParallelEmbedding` whose weight this head shares (tied embeddings:
            the same vocabulary rows serve both), or ``None`` for a head with its own weight.

    ``forward``: ``hidden (..., in_features)`` -> on the driver rank (``tp_rank == 0``) the full
    ``(..., vocab_size)`` logits; on every other rank an empty ``(..., 0)`` tensor of the same dtype
    (no vocabulary columns: those ranks must not sample, and an ``argmax`` over it raises). Eagerly
    this is one ``gather`` to the driver (``(tp - 1) / tp`` of the logits cross ranks); under
    ``torch.compile`` (a whole-model graph) it is a traceable all-gather instead.
    """

    def __init__(self, in_features: int, vocab_size: int, tp_rank: int, tp_size: int, group_name: str,
                 like: torch.Tensor, tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        start, stop, size = padded_range(vocab_size, tp_rank, tp_size)
        self.in_features, self.vocab_size = in_features, vocab_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard = Shard(0, start, stop, size)
        self.group_name = group_name
        self.linear = nn.Linear(in_features, size, bias=False, device="meta")
        self.linear.weight = tied.weight if tied is not None else _empty_weight(size, in_features, like)

    @property
    def weight(self) -> nn.Parameter:
        """This rank's ``(ceil(vocab / tp), hidden)`` rows (what transformers' ``tie_weights`` reads)."""
        return self.linear.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        local = self.linear(hidden).contiguous()
        if torch.compiler.is_compiling():
            full = all_gather_last_dim(local, self.group_name)
        else:
            full = gather_last_dim_to_driver(local, self.group_name, self.tp_rank, self.tp_size)
            if full is None:
                return local[..., :0]
        return full[..., :self.vocab_size] if self.tp_rank == DRIVER_RANK else local[..., :0]


class RowParallelExperts(nn.Module):
    """``moe_tp_experts``: ``y = all_reduce(experts(x, top_k_index, top_k_weights))``.

    Args:
        experts: a transformers ``*Experts`` module (fused 3-D ``gate_up_proj (E, 2 * I / tp, hidden)``
            and ``down_proj (E, hidden, I / tp)``) whose parameters already hold this rank's slice of
            every expert's intermediate features; it runs unmodified.
        group_name: the TP process group's name.

    ``forward``: the experts' own arguments (``hidden (tokens, hidden)``, the router's top-k indices
    and weights, replicated on every rank) -> ``(tokens, hidden)``, same dtype. Each rank's experts
    give a partial down-projection (Megatron's row-parallel sum), so one all-reduce of ``hidden``
    elements per token completes the block; the routing weights multiply each partial sum, which
    distributes over the sum.
    """

    def __init__(self, experts: nn.Module, group_name: str) -> None:
        super().__init__()
        self.experts = experts
        self.group_name = group_name

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        return all_reduce(self.experts(*args, **kwargs), self.group_name)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over ``full_features`` values of which this rank holds a slice (OLMo 2 / OLMoE q/k norm).

    ``y = w[shard] * x / sqrt(sum_all_ranks(x**2) / replicas / full_features + eps)``, computed in
    float32 as transformers' ``Olmo2RMSNorm`` does; ``weight_after_cast`` multiplies the weight after
    casting back to the input dtype (``OlmoeRMSNorm``'s order). vLLM gathers q and k before such a norm
    and splits them after; summing squares needs one all-reduce of one value per token instead.

    Args:
        local_features: features this rank holds; full_features: the width the norm is over.
        eps: the norm's epsilon.
        replicas: ranks holding each value (``tp / num_kv_heads`` for a k norm whose KV heads are
            replicated, else 1): the all-reduced sum counts each value that many times.
        weight_after_cast: see above.
        group_name, like: as :class:`RowParallelLinear`.

    ``forward``: ``x (..., local_features)`` -> same shape and dtype.
    """

    def __init__(self, local_features: int, full_features: int, eps: float, replicas: int, weight_after_cast: bool,
                 group_name: str, like: torch.Tensor) -> None:
        super().__init__()
        self.full_features, self.eps, self.replicas = full_features, eps, replicas
        self.weight_after_cast = weight_after_cast
        self.group_name = group_name
        self.weight = nn.Parameter(torch.empty(local_features, dtype=like.dtype, device=like.device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        dtype = x.dtype
        h = x.to(torch.float32)
        squares = all_reduce(h.pow(2).sum(-1, keepdim=True), self.group_name)
        h = h * torch.rsqrt(squares / (self.replicas * self.full_features) + self.eps)
        return self.weight * h.to(dtype) if self.weight_after_cast else (self.weight * h).to(dtype)
