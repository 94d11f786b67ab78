"""Expert parallelism: whole experts sharded over the tensor-parallel ranks, tokens dispatched and combined.

vLLM's ``enable_expert_parallel`` contract: the MoE layers' experts are split across the ranks instead of
every expert's weights being tensor-parallel-sharded; attention stays tensor-parallel. Rank ``r`` of ``n``
holds the physical expert slots ``[r * P / n, (r + 1) * P / n)`` (``P = num_experts +
parallel.num_redundant_experts``), each slot one logical expert's whole ``gate_up_proj`` and ``down_proj``
(which logical expert: :mod:`framework.model_executor.eplb`'s ``physical_to_logical_map``). The model's own
experts module runs unchanged on the local slots: every token's chosen logical expert is mapped to one of
its replicas (``logical_to_physical_map``; the replica ``token % replicas``, identical on every rank), and
to the local slot index, or to ``num_local`` (transformers' EP sentinel, which its experts forwards skip)
when another rank owns it.

Dispatch and combine (``parallel.all2all_backend``, vLLM's names). Under tensor parallelism every rank
already holds every token's hidden state, so dispatching needs no communication; the combine does:

* ``naive``: all-reduce the partial outputs (vLLM's naive backend broadcasts tokens, then all-reduces);
* ``allgather_reducescatter``: reduce-scatter the partial outputs over token chunks (each rank sums one
  chunk), then all-gather the chunks back, since the next attention layer needs every token on every rank.

Both give the same sum; with top-2 routing it is exactly transformers' float32 sum (``0 + a + b``).
The ``expert_load`` buffer of each layer counts the tokens routed to every logical expert since the last
:func:`rebalance` (identical on every rank: all see every token), the metric EPLB balances.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from framework.distributed.communication_op import all_reduce
from framework.distributed.parallel_state import ensure_model_parallel_initialized
from framework.model_executor.eplb import ExpertMaps, default_maps, rebalance_experts
from framework.model_executor.model_loader import LoadedModel, resolve_model_path
from framework.model_executor.parallel_layers import Shard
from framework.model_executor.tensor_parallel import meta_model, shard_model, tp_problems
from framework.model_executor.tp_styles import EXPERT_LEAVES, ExpertSlices, LocalSources, RankDims
from framework.model_executor.tp_weights import load_weights, loaded_sharded_model

ALL2ALL_BACKENDS = ("allgather_reducescatter", "naive")  # vLLM's parallel.all2all_backend names served here
#: families with experts that expert parallelism refuses, and why
EP_REFUSED = {"gpt_oss": "its experts carry biases and a clamped SwiGLU, and the family is not verified under "
                         "tensor parallelism (attention sinks per head)",
              **dict.fromkeys(("deepseek_v2", "deepseek_v3"),
                              "its experts (grouped sigmoid router, shared experts) are verified with MLA under "
                              "tensor parallelism only, not placed whole per rank"),
              "qwen2_moe": "no tiny Qwen2-MoE model in servelab's family table to verify against transformers"}
#: model types whose fused experts and per-expert checkpoint names are known (the EP acceptance families)
EP_MODEL_TYPES = tuple(kind for kind in EXPERT_LEAVES if kind not in EP_REFUSED)


@dataclass(frozen=True)
class ExpertParallelConfig:
    """The ``parallel.*`` keys of expert parallelism (vLLM's names; ``eplb_step_interval`` is EPLBConfig's
    ``step_interval``)."""

    all2all_backend: str = "allgather_reducescatter"  # combine: see the module docstring
    enable_eplb: bool = False  # rebalance the expert maps from measured loads
    num_redundant_experts: int = 0  # extra physical slots holding replicas of hot experts (needs enable_eplb)
    eplb_step_interval: int = 3000  # engine steps between rebalances (with enable_eplb)

    @classmethod
    def of(cls, config: object) -> ExpertParallelConfig:
        """The settings of an ``EngineConfig`` (its fields of the same names)."""
        return cls(**{key: getattr(config, key) for key in cls.__dataclass_fields__})


def _num_experts(config: object) -> int | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(text, key, None):
            return int(getattr(text, key))
    return None


def ep_problems(hf_config: object, tp_size: int, ep: ExpertParallelConfig) -> list[str]:
    """Why ``hf_config``'s model cannot run expert-parallel over ``tp_size`` ranks with ``ep`` (empty: it can).

    Checked before any worker starts (the config only). Dense families, ``tp_size < 2``, unknown backends,
    redundant experts without EPLB and expert counts the ranks cannot split are refused, each naming the fix.
    """
    model_type = getattr(hf_config, "model_type", "?")
    num_experts = _num_experts(hf_config)
    if num_experts is None:
        return [f"enable_expert_parallel needs a mixture-of-experts model; {model_type!r} is dense: "
                "set parallel.enable_expert_parallel=false"]
    if model_type in EP_REFUSED or model_type not in EP_MODEL_TYPES:
        reason = EP_REFUSED.get(model_type, "its experts are not verified under expert parallelism")
        return [f"{model_type!r} is not run expert-parallel: {reason}; supported: {list(EP_MODEL_TYPES)}"]
    problems = []
    if tp_size < 2:
        problems.append("enable_expert_parallel shards experts over the tensor-parallel ranks: "
                        f"set parallel.tensor_parallel_size >= 2 (got {tp_size})")
    if ep.all2all_backend not in ALL2ALL_BACKENDS:
        problems.append(f"parallel.all2all_backend must be one of {list(ALL2ALL_BACKENDS)}, got {ep.all2all_backend!r}")
    if ep.num_redundant_experts < 0 or (ep.num_redundant_experts and not ep.enable_eplb):
        problems.append(f"parallel.num_redundant_experts={ep.num_redundant_experts}: redundant experts are "
                        "placed by EPLB (set parallel.enable_eplb=true), and must be >= 0")
    if ep.enable_eplb and ep.eplb_step_interval < 1:
        problems.append(f"parallel.eplb_step_interval must be >= 1, got {ep.eplb_step_interval}")
    physical = num_experts + max(ep.num_redundant_experts, 0)
    if tp_size >= 2 and physical % tp_size:
        problems.append(f"{num_experts} experts + {ep.num_redundant_experts} redundant are not divisible by "
                        f"{tp_size} ranks: set parallel.num_redundant_experts to {(-num_experts) % tp_size} "
                        "(with enable_eplb) or a tensor_parallel_size dividing the experts")
    return problems


class ExpertParallelExperts(nn.Module):
    """One MoE layer's local expert slots behind the dispatch and combine of the module docstring.

    Args:
        experts: the transformers ``*Experts`` module holding this rank's ``num_local`` slots
            (``gate_up_proj (num_local, 2 * I, hidden)``, ``down_proj (num_local, hidden, I)``).
        maps: this layer's row of :class:`~framework.model_executor.eplb.ExpertMaps` (``num_layers == 1``).
        ep_rank, ep_size: this rank and the ranks; group_name: their process group; backend: see
            :data:`ALL2ALL_BACKENDS`.

    ``forward(hidden (tokens, hidden), top_k_index (tokens, k) int64 logical ids, top_k_weights (tokens, k))``
    -> ``(tokens, hidden)`` in ``hidden``'s dtype, the whole MoE output on every rank.
    """

    def __init__(self, experts: nn.Module, maps: ExpertMaps, ep_rank: int, ep_size: int, group_name: str,
                 backend: str) -> None:
        super().__init__()
        self.experts, self.ep_rank, self.ep_size = experts, ep_rank, ep_size
        self.group_name, self.backend = group_name, backend
        self.num_local = maps.num_physical_experts // ep_size
        self.num_logical = int(maps.logical_replica_count.shape[1])
        self.register_buffer("expert_load", torch.zeros(self.num_logical, dtype=torch.int64), persistent=False)
        # the same counts since the model loaded (metrics.json's expert_load); expert_load restarts at each rebalance
        self.register_buffer("expert_load_total", torch.zeros(self.num_logical, dtype=torch.int64), persistent=False)
        self.set_maps(maps)

    def set_maps(self, maps: ExpertMaps) -> None:
        """Route by ``maps`` (one layer's row) from now on; the weights must already match it."""
        self.physical_to_logical = maps.physical_to_logical_map[0].clone()
        self.logical_to_physical = maps.logical_to_physical_map[0].clone()
        self.replica_count = maps.logical_replica_count[0].clone()

    def local_slots(self) -> torch.Tensor:
        """``(num_local,)`` int64: the logical expert each local slot holds."""
        first = self.ep_rank * self.num_local
        return self.physical_to_logical[first:first + self.num_local]

    def dispatch(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical ids -> local slot ids (``num_local`` where another rank computes it) and their weights
        (zero at those), both ``(tokens, k)``."""
        tokens = torch.arange(top_k_index.shape[0], device=top_k_index.device).unsqueeze(1)
        count = self.replica_count.to(top_k_index.device)[top_k_index]
        physical = self.logical_to_physical.to(top_k_index.device)[top_k_index, tokens % count]
        local = physical - self.ep_rank * self.num_local
        remote = (local < 0) | (local >= self.num_local)
        return local.masked_fill(remote, self.num_local), top_k_weights.masked_fill(remote, 0)

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's ``partial (tokens, hidden)``, on every rank (see the module docstring)."""
        if self.backend == "naive":
            return all_reduce(partial, self.group_name)
        num_tokens = partial.shape[0]
        padded = nn.functional.pad(partial, (0, 0, 0, (-num_tokens) % self.ep_size))
        chunk = funcol.reduce_scatter_single(padded, "sum", 0, self.group_name)
        gathered = funcol.all_gather_single(_wait(chunk), 0, self.group_name)
        return _wait(gathered)[:num_tokens]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """See the class docstring."""
        counts = torch.bincount(top_k_index.flatten(), minlength=self.num_logical).to(self.expert_load)
        self.expert_load += counts
        self.expert_load_total += counts
        local, weights = self.dispatch(top_k_index, top_k_weights)
        return self.combine(self.experts(hidden, local, weights))


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class ExpertSharder:
    """``tensor_parallel.shard_model``'s ``experts_style`` under expert parallelism: each ``moe_tp_experts``
    module keeps this rank's whole expert slots, read from the per-expert checkpoint tensors.

    Args:
        num_layers: decoder layers (map rows; the layer number in a module's name picks its row).
        num_experts: logical experts per layer; ep: the settings (:func:`ep_problems` empty).
    """

    def __init__(self, num_layers: int, num_experts: int, tp_size: int, ep: ExpertParallelConfig) -> None:
        self.ep = ep
        self.maps = default_maps(num_layers, num_experts, num_experts + ep.num_redundant_experts, tp_size)

    def __call__(self, experts: nn.Module, name: str, dims: RankDims,
                 model_type: str) -> tuple[nn.Module, LocalSources]:
        """The :class:`ExpertParallelExperts` replacing ``experts`` (on ``meta``) and its weight sources."""
        layer = int(re.search(r"\.(\d+)\.", f".{name}.").group(1))
        row = ExpertMaps(*(m[layer:layer + 1] for m in (self.maps.physical_to_logical_map,
                                                        self.maps.logical_to_physical_map,
                                                        self.maps.logical_replica_count)))
        module = ExpertParallelExperts(experts, row, dims.tp_rank, dims.tp_size, dims.group_name,
                                       self.ep.all2all_backend)
        ids = tuple(module.local_slots().tolist())
        _, two_i, hidden = experts.gate_up_proj.shape
        like = experts.gate_up_proj
        experts.gate_up_proj = nn.Parameter(torch.empty(len(ids), two_i, hidden, dtype=like.dtype, device="meta"),
                                            requires_grad=False)
        experts.down_proj = nn.Parameter(torch.empty(len(ids), hidden, two_i // 2, dtype=like.dtype, device="meta"),
                                         requires_grad=False)
        experts.num_experts = len(ids)
        # transformers' EP flag: its grouped_mm / batched_mm experts forwards mask the sentinel rows only then
        experts._is_expert_parallel = True
        gate, up, down = EXPERT_LEAVES[model_type]
        half = two_i // 2
        sources: LocalSources = {
            "experts.gate_up_proj": ("", ExpertSlices(len(ids), (gate, up), Shard(0, 0, half, half), ids)),
            "experts.down_proj": ("", ExpertSlices(len(ids), (down,), Shard(1, 0, half, half), ids))}
        return module, sources


def load_ep_model(model: str, dtype: str, device: str, tp_rank: int, tp_size: int, attn_implementation: str,
                  ep: ExpertParallelConfig) -> LoadedModel:
    """This rank's expert-parallel shard of ``model``: attention (and any dense MLP) tensor-parallel as
    :func:`~framework.model_executor.tp_weights.load_tp_model`, the MoE layers' whole experts split by
    :class:`ExpertSharder` (only this rank's experts are read from the checkpoint).

    Runs in every rank with ``torch.distributed`` initialised (the default group is the TP group, as in
    ``load_tp_model``). Returns what ``load_tp_model`` returns; ``dtype`` is a torch dtype name.

    Raises:
        ValueError: :func:`ep_problems` or ``tp_problems`` is not empty, or the checkpoint is pre-quantized
            (expert parallelism reads float experts); RuntimeError: ``torch.distributed`` not initialised.
    """
    import torch.distributed as dist
    from transformers import AutoConfig

    if not dist.is_initialized():
        raise RuntimeError("load_ep_model needs torch.distributed initialised (the executor's worker does it)")
    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    problems = ep_problems(config, tp_size, ep) or tp_problems(config, tp_size)
    if getattr(config, "quantization_config", None) is not None:
        problems.append("a pre-quantized checkpoint is not run expert-parallel: use its float weights")
    if problems:
        raise ValueError("; ".join(problems))
    group = ensure_model_parallel_initialized(tp_size, torch.device(device).type, communicator="torch_distributed")
    sharder = ExpertSharder(int(config.get_text_config().num_hidden_layers), _num_experts(config), tp_size, ep)
    net = meta_model(config, dtype=getattr(torch, dtype), attn_implementation=attn_implementation)
    sources = shard_model(net, group.rank_in_group, tp_size, group.group_name, experts_style=sharder)
    load_weights(net, path, sources, torch.device(device))
    net.eval().requires_grad_(False)
    if ep.enable_eplb:  # on the first MoE layer: every forward path runs it (the runner may call the decoder alone)
        net.eplb_schedule = EplbSchedule(ep.eplb_step_interval, net)
        ep_layers(net)[0].register_forward_pre_hook(net.eplb_schedule)
    return loaded_sharded_model(net, path)


class EplbSchedule:
    """A forward pre-hook on the first MoE layer of ``model``: :func:`rebalance` before every
    ``step_interval``-th forward. Every rank runs the same forwards (one per engine step, in lockstep), so all
    rebalance at the same step. Kept out of compiled graphs (a compiled decoder falls back to eager)."""

    def __init__(self, step_interval: int, model: nn.Module) -> None:
        self.step_interval, self.model = step_interval, model
        self.num_forwards, self.num_rebalances = 0, 0

    @torch.compiler.disable
    def __call__(self, layer: nn.Module, args: tuple) -> None:
        """Count the forward; rebalance when ``step_interval`` have run since the last one."""
        self.num_forwards += 1
        if self.num_forwards % (self.step_interval + 1) == 0:
            rebalance(self.model)
            self.num_rebalances += 1


def ep_layers(model: nn.Module) -> list[ExpertParallelExperts]:
    """The model's expert-parallel MoE layers, in layer order."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]


def expert_load(model: nn.Module) -> torch.Tensor:
    """``(num_moe_layers, num_experts)`` int64: tokens routed to each logical expert since the last rebalance."""
    return torch.stack([layer.expert_load.cpu() for layer in ep_layers(model)])


def worker_expert_load(worker: Any) -> list[list[int]]:
    """Run on a rank by ``collective_rpc``: its model's per layer, per expert token counts since loading."""
    return [layer.expert_load_total.tolist() for layer in ep_layers(worker.runner.model)]


class RankZeroExpertLoad:
    """``MetricsCollector.expert_load``: the driver rank's counts, read live when ``metrics.json`` is written
    (every rank counts the same tokens). ``executor``: anything with ``collective_rpc``."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor

    def as_dict(self) -> dict[str, Any]:
        """``{"expert_load": [[tokens per expert] per MoE layer]}``; ``None`` once the ranks are gone."""
        try:
            return {"expert_load": self.executor.collective_rpc(worker_expert_load, unique_reply_rank=0)[0]}
        except Exception:  # a dead or shut-down executor: the summary is still written, without the loads
            return {"expert_load": None}


@torch.inference_mode()
def rebalance(model: nn.Module) -> ExpertMaps:
    """EPLB step, on every rank at the same step: new maps from :func:`expert_load`
    (:func:`~framework.model_executor.eplb.rebalance_experts`), each layer's slots all-gathered and the
    ones this rank now owns kept, the loads reset. For one layer at a time every rank briefly holds all
    of that layer's slots (vLLM moves only the changed experts point to point).

    Returns:
        The new maps (one row per MoE layer).
    """
    layers = ep_layers(model)
    load = expert_load(model)
    maps = rebalance_experts(load, layers[0].num_local * layers[0].ep_size, layers[0].ep_size)
    for i, layer in enumerate(layers):
        old_slot_of = layer.logical_to_physical[:, 0]  # any replica of each logical expert holds its weights
        row = ExpertMaps(maps.physical_to_logical_map[i:i + 1], maps.logical_to_physical_map[i:i + 1],
                         maps.logical_replica_count[i:i + 1])
        layer.set_maps(row)
        take = old_slot_of[layer.local_slots()]
        for param in ("gate_up_proj", "down_proj"):
            local = getattr(layer.experts, param)
            every = _wait(funcol.all_gather_single(local.contiguous(), 0, layer.group_name))
            local.copy_(every[take.to(every.device)])
        layer.expert_load.zero_()
    return maps
