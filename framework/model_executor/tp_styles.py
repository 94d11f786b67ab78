"""One function per tensor-parallel plan style: the module a rank holds instead of the planned one,
and where its parameters come from in the checkpoint.

Used by :func:`framework.model_executor.tensor_parallel.shard_model` on a model built on ``meta``.
Megatron-LM's split (Shoeybi et al., 2019): column-parallel layers keep a slice of their output
features, row-parallel ones a slice of their inputs and all-reduce. Style names are transformers'
``tp_plan`` names where one exists (``colwise``, ``rowwise``, ``colwise_rep`` /
``colwise_gather_output``, ``packed_colwise``, ``moe_tp_experts``), plus two of servelab's that
``tensor_parallel.PLAN_OVERRIDES`` puts where transformers' plan gathers whole projections instead of
sharding heads: ``qkv_colwise`` (a packed q/k/v projection split by heads, vLLM's
``QKVParallelLinear``) and ``sharded_norm`` (:class:`~framework.model_executor.parallel_layers.ShardedRMSNorm`).

Heads: rank ``r`` holds query heads ``[r * H / tp, (r + 1) * H / tp)``. KV heads are split the same
way when ``tp`` divides their count ``K``; when ``tp`` is a multiple of ``K`` each KV head is
replicated on ``tp / K`` consecutive ranks (rank ``r`` holds KV head ``r // (tp / K)``, vLLM's
``QKVParallelLinear`` rule), which is the KV head its query heads attend to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.model_executor.parallel_layers import (
    GatheredColumnParallelLinear,
    PackedShard,
    RowParallelExperts,
    RowParallelLinear,
    Shard,
    ShardedRMSNorm,
    even_range,
)

KV_PROJECTIONS = ("k_proj", "v_proj")  # colwise leaves holding KV heads (replicated when tp > K)

#: model_type -> per-expert leaf names of (gate, up, down) in checkpoints, which store experts one by one
#: (``experts.<e>.<leaf>.weight``: the Hub's files and what ``save_pretrained`` writes; transformers fuses
#: them while loading, ``conversion_mapping.py``).
EXPERT_LEAVES = {"mixtral": ("w1", "w3", "w2"),
                 **dict.fromkeys(("qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"), ("gate_proj", "up_proj", "down_proj"))}


@dataclass(frozen=True)
class ExpertSlices:
    """A fused 3-D experts parameter read from per-expert 2-D checkpoint tensors: for each expert ``e``,
    ``shard`` of ``<key>.<e>.<leaf>.weight`` for each of ``leaves``, concatenated along dim 0, then the
    experts stacked (``gate_up_proj (E, 2 * I / tp, hidden)``, ``down_proj (E, hidden, I / tp)``)."""

    num_experts: int  # E
    leaves: tuple[str, ...]  # ("w1", "w3") for Mixtral's gate/up, ("w2",) for its down
    shard: Shard  # of each per-expert weight: rows of gate/up (dim 0), columns of down (dim 1)
    expert_ids: tuple[int, ...] = ()  # checkpoint experts to read, in order (empty: 0 .. num_experts - 1; EP's slots)

    def ids(self) -> tuple[int, ...]:
        """The checkpoint experts read, in stacking order."""
        return self.expert_ids or tuple(range(self.num_experts))


#: param name in the sharded model, relative to the planned module -> (tensor name relative to the
#: planned module in the checkpoint, this rank's slice or None: whole)
LocalSources = dict[str, tuple[str, Shard | PackedShard | ExpertSlices | None]]


@dataclass(frozen=True)
class RankDims:
    """What every style needs to know about the rank and the model's heads."""

    tp_rank: int  # this rank in the TP group
    tp_size: int  # ranks in the TP group
    group_name: str  # the TP process group's name (the collectives' handle)
    num_heads: int  # query heads of the full model
    num_kv_heads: int  # KV heads of the full model
    head_dim: int  # features per head

    def collective_args(self) -> dict[str, object]:
        """The keyword arguments every parallel layer takes."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "group_name": self.group_name}

    def kv_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the KV heads this rank holds."""
        return kv_head_range(self.num_kv_heads, self.tp_rank, self.tp_size)

    def q_range(self) -> tuple[int, int]:
        """``[start, stop)`` of the query heads this rank holds."""
        return even_range(self.num_heads, self.tp_rank, self.tp_size)


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``tp_rank`` holds (see the module docstring)."""
    if tp_size <= num_kv_heads:
        return even_range(num_kv_heads, tp_rank, tp_size)
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


def _meta_linear(in_features: int, out_features: int, like: nn.Linear) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=like.bias is not None, device="meta", dtype=like.weight.dtype)


def _rows(shard: Shard | PackedShard, bias: bool) -> LocalSources:
    sources: LocalSources = {"weight": ("weight", shard)}
    if bias:  # a 1-D bias takes the same rows (dim 0) as the weight
        sources["bias"] = ("bias", shard)
    return sources


def colwise(linear: nn.Linear, name: str, dims: RankDims) -> tuple[nn.Module, LocalSources]:
    """``colwise``: a plain ``nn.Linear`` holding this rank's output rows (KV projections: its KV heads' rows)."""
    if name.rpartition(".")[2] in KV_PROJECTIONS:
        first, last = dims.kv_range()
        start, stop = first * dims.head_dim, last * dims.head_dim
    else:
        start, stop = even_range(linear.out_features, dims.tp_rank, dims.tp_size)
    return _meta_linear(linear.in_features, stop - start, linear), _rows(Shard(0, start, stop, stop - start),
                                                                         linear.bias is not None)


def packed_colwise(linear: nn.Linear, dims: RankDims) -> tuple[nn.Module, LocalSources]:
    """``packed_colwise`` on a fused ``gate_up_proj`` (``[gate; up]`` rows): this rank's gate rows, then
    the same rows of up (vLLM's ``MergedColumnParallelLinear``), so the model's ``chunk(2)`` still splits it."""
    half = linear.out_features // 2
    start, stop = even_range(half, dims.tp_rank, dims.tp_size)
    shard = PackedShard(tuple(Shard(0, off + start, off + stop, stop - start) for off in (0, half)))
    return _meta_linear(linear.in_features, shard.size, linear), _rows(shard, linear.bias is not None)


def qkv_colwise(linear: nn.Linear, dims: RankDims) -> tuple[nn.Module, LocalSources]:
    """``qkv_colwise`` on a fused ``qkv_proj`` (``[q; k; v]`` rows, Phi-3): this rank's query heads, then
    its KV heads' key and value rows (vLLM's ``QKVParallelLinear``)."""
    d, num_q = dims.head_dim, dims.num_heads * dims.head_dim
    (q0, q1), (k0, k1) = dims.q_range(), dims.kv_range()
    sections = (Shard(0, q0 * d, q1 * d, (q1 - q0) * d),
                *(Shard(0, off + k0 * d, off + k1 * d, (k1 - k0) * d) for off in (num_q, num_q + dims.num_kv_heads * d)))
    shard = PackedShard(sections)
    return _meta_linear(linear.in_features, shard.size, linear), _rows(shard, linear.bias is not None)


def rowwise(linear: nn.Linear, dims: RankDims) -> tuple[nn.Module, LocalSources]:
    """``rowwise``: :class:`RowParallelLinear` (input features split, all-reduce, bias once)."""
    new = RowParallelLinear(linear.in_features, linear.out_features, linear.bias is not None, like=linear.weight,
                            **dims.collective_args())
    sources: LocalSources = {"linear.weight": ("weight", new.shard)}
    if linear.bias is not None:
        sources["bias"] = ("bias", None)
    return new, sources


def gathered(linear: nn.Linear, dims: RankDims) -> tuple[nn.Module, LocalSources]:
    """``colwise_rep`` / ``colwise_gather_output``: :class:`GatheredColumnParallelLinear`."""
    new = GatheredColumnParallelLinear(linear.in_features, linear.out_features, linear.bias is not None,
                                       like=linear.weight, **dims.collective_args())
    sources: LocalSources = {"linear.weight": ("weight", new.shard)}
    if linear.bias is not None:
        sources["linear.bias"] = ("bias", new.shard)
    return new, sources


def sharded_norm(norm: nn.Module, name: str, dims: RankDims, weight_after_cast: bool) -> tuple[nn.Module, LocalSources]:
    """``sharded_norm`` on a ``q_norm`` / ``k_norm`` over the full projection width (OLMo 2, OLMoE):
    :class:`ShardedRMSNorm` holding the weight of this rank's heads.

    Raises:
        ValueError: ``name`` is neither a ``q_norm`` nor a ``k_norm``.
    """
    leaf = name.rpartition(".")[2]
    if leaf not in ("q_norm", "k_norm"):
        raise ValueError(f"sharded_norm applies to q_norm / k_norm, not {name!r}")
    d = dims.head_dim
    if leaf == "q_norm":
        (first, last), full, replicas = dims.q_range(), dims.num_heads * d, 1
    else:
        (first, last), full = dims.kv_range(), dims.num_kv_heads * d
        replicas = max(1, dims.tp_size // dims.num_kv_heads)
    new = ShardedRMSNorm((last - first) * d, full, float(norm.variance_epsilon), replicas, weight_after_cast,
                         dims.group_name, like=norm.weight)
    return new, {"weight": ("weight", Shard(0, first * d, last * d, (last - first) * d))}


def experts_problems(experts: nn.Module, model_type: str) -> list[str]:
    """Why ``experts`` is not a fused-experts module :func:`moe_tp_experts` can shard (empty: it is)."""
    params = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False)}
    if set(params) != {"gate_up_proj", "down_proj"} or any(len(s) != 3 for s in params.values()):
        return [f"{type(experts).__name__} holds {sorted(params)}, not fused 3-D gate_up_proj and down_proj alone"]
    if model_type not in EXPERT_LEAVES:
        return [f"the per-expert checkpoint names of {model_type!r} are not known (EXPERT_LEAVES)"]
    return []


def moe_tp_experts(experts: nn.Module, dims: RankDims, model_type: str) -> tuple[nn.Module, LocalSources]:
    """``moe_tp_experts`` (with ``packed_colwise`` ``gate_up_proj`` and ``rowwise`` ``down_proj``): every
    expert keeps a slice of its intermediate features; :class:`RowParallelExperts` all-reduces the sum.
    The experts module itself is kept (its forward and any experts kernel run unchanged); its weights
    come from the per-expert checkpoint tensors (:data:`EXPERT_LEAVES`)."""
    num_experts, two_i, hidden = experts.gate_up_proj.shape
    start, stop = even_range(two_i // 2, dims.tp_rank, dims.tp_size)
    local = stop - start
    like = experts.gate_up_proj
    experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden, dtype=like.dtype, device="meta"),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, local, dtype=like.dtype, device="meta"),
                                     requires_grad=False)
    if hasattr(experts, "intermediate_dim"):
        experts.intermediate_dim = local
    gate, up, down = EXPERT_LEAVES[model_type]
    sources: LocalSources = {
        "experts.gate_up_proj": ("", ExpertSlices(num_experts, (gate, up), Shard(0, start, stop, local))),
        "experts.down_proj": ("", ExpertSlices(num_experts, (down,), Shard(1, start, stop, local)))}
    return RowParallelExperts(experts, dims.group_name), sources
