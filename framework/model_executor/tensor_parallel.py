"""Tensor parallelism for unmodified transformers models, driven by the model's own ``tp_plan``.

The way vLLM's Transformers modeling backend does it (``recursive_replace``): the model is built on
the ``meta`` device, every ``nn.Linear`` leaf its plan names is swapped for a tensor-parallel layer
(``framework/model_executor/parallel_layers.py``), the input embedding is vocab-parallel and the LM head
gathers logits to the driver; then each rank reads only its slices of the safetensors checkpoint
(``framework/model_executor/tp_weights.py``). The model code itself is untouched.

Plan styles (transformers' names, ``model.tp_plan`` = ``config.base_model_tp_plan`` + the head's, with
:data:`PLAN_OVERRIDES` where transformers gathers whole projections instead of sharding heads; each
style's module is built in ``framework/model_executor/tp_styles.py``): ``colwise`` (output features
split), ``rowwise`` (input features split, all-reduce), ``colwise_rep`` / ``colwise_gather_output``
(split then all-gathered; on the LM head: gathered to the driver only), ``packed_colwise`` (a fused
``gate_up_proj``), ``qkv_colwise`` (a fused ``qkv_proj``, split by heads), ``moe_tp_experts`` (fused
experts split along their intermediate features, all-reduced), ``sharded_norm`` (a q/k norm over the
full projection width), ``embedding_rowwise`` (vocab-parallel embedding, applied whether or not the
plan names it, as vLLM does; Gemma's scaled embedding keeps its scale), ``replicated_with_grad_allreduce``
/ ``replicate`` (kept whole: per-head norms, MLA's down-projections). Any other style is refused by
:func:`tp_problems`.

MLA (DeepSeek-V2/V3) splits its query heads and replicates its latent KV: every rank computes the whole
latent from the replicated ``kv_a_proj_with_mqa`` and caches it (:func:`shard_layer_specs`), and absorbs its
own heads' slice of ``kv_b_proj`` (``framework/model_executor/mla.py``).

Which families run at all is each family's ``tp`` record (``framework/model_executor/model_families.py``):
:data:`~framework.model_executor.model_families.TP_VERIFIED` (its tiny model's greedy output at TP=2
equals transformers', ``tests/framework/model_executor/test_tensor_parallel_families.py``) or the
reason it is refused, which :func:`tp_problems` returns before any worker starts.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.model_executor import tp_styles
from framework.model_executor.model_families import TP_VERIFIED, family_of, is_mla
from framework.model_executor.parallel_layers import PackedShard, ParallelLMHead, Shard, VocabParallelEmbedding
from framework.model_executor.tp_styles import KV_PROJECTIONS, ExpertSlices, RankDims, kv_head_range

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from framework.interfaces import AttentionLayerSpec


GATHERED_STYLES = ("colwise_rep", "colwise_gather_output")
REPLICATED_STYLES = ("replicated_with_grad_allreduce", "replicate")
SUPPORTED_STYLES = ("colwise", "rowwise", "embedding_rowwise", "packed_colwise", "qkv_colwise", "moe_tp_experts",
                    "sharded_norm", *GATHERED_STYLES, *REPLICATED_STYLES)
#: model_type -> {base-model plan key: style} replacing transformers' plan entries (or adding ones):
#: Phi-3's and OLMo's plans all-gather q/k/v and split them again before ``o_proj``, so every rank
#: would compute (and cache) every head; these shard heads instead, as vLLM's Phi-3 and OLMo 2 do.
PLAN_OVERRIDES: dict[str, dict[str, str]] = {
    "phi3": {"layers.*.self_attn.qkv_proj": "qkv_colwise", "layers.*.self_attn.o_proj": "rowwise",
             "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise"},
    **{kind: {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
              "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.self_attn.q_norm": "sharded_norm", "layers.*.self_attn.k_norm": "sharded_norm"}
       for kind in ("olmo2", "olmoe")},
    # MLA (DeepSeek-V2/V3) split by heads as vLLM's DeepseekV2MLAAttention: the per-head up-projections
    # (q_proj or q_b_proj, kv_b_proj) column-parallel, o_proj row-parallel; the down-projections q_a_proj and
    # kv_a_proj_with_mqa (whose output is the latent every head reads) and their norms whole on every rank.
    **{kind: {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
              "layers.*.self_attn.kv_b_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.self_attn.q_a_proj": "replicate", "layers.*.self_attn.kv_a_proj_with_mqa": "replicate"}
       for kind in ("deepseek_v2", "deepseek_v3")},
}
#: model types whose RMSNorm multiplies its weight after casting back to the input dtype (``OlmoeRMSNorm``)
WEIGHT_AFTER_CAST_NORMS = frozenset({"olmoe"})

#: param name in the sharded model -> (tensor name in the checkpoint, this rank's slice or None: whole)
WeightSources = dict[str, tuple[str, Shard | PackedShard | ExpertSlices | None]]
#: what replaces ``moe_tp_experts`` under expert parallelism: (experts module, its name, dims, model_type)
#: -> (module, LocalSources) (``framework/model_executor/expert_parallel.py``'s ``ExpertSharder``)
ExpertsStyle = Callable[[nn.Module, str, RankDims, str], tuple[nn.Module, dict]]


@dataclass
class TPLayout:
    """What one tensor-parallel rank holds; the attention backend and KV cache are sized from it."""

    tp_rank: int  # this rank in the TP group, 0 = driver
    tp_size: int  # ranks in the TP group
    num_heads: int  # query heads on this rank: num_attention_heads / tp_size
    num_kv_heads: int  # KV heads on this rank: num_key_value_heads / tp_size, or 1 when replicated (MLA: its
    # query heads' expanded K/V; the latent cache's one head is shard_layer_specs')


def _heads(hf_config: PretrainedConfig) -> tuple[int, int, int]:
    text = hf_config.get_text_config()
    num_heads = int(text.num_attention_heads)
    num_kv = int(getattr(text, "num_key_value_heads", None) or num_heads)
    if is_mla(text):  # K/V expanded from the latent per query head (the latent cache's one head: shard_layer_specs)
        num_kv = num_heads
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
    return num_heads, num_kv, head_dim


def rank_layout(hf_config: PretrainedConfig, tp_rank: int, tp_size: int) -> TPLayout:
    """The heads rank ``tp_rank`` of ``tp_size`` holds.

    Raises:
        ValueError: ``tp_rank`` outside ``[0, tp_size)`` or head counts ``tp_size`` cannot split
            (:func:`tp_problems` names the valid sizes).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
    num_heads, num_kv, _ = _heads(hf_config)
    if num_heads % tp_size or (num_kv % tp_size and tp_size % num_kv):
        raise ValueError(f"tensor_parallel_size={tp_size} cannot split {num_heads} query / {num_kv} KV heads")
    start, stop = kv_head_range(num_kv, tp_rank, tp_size)
    return TPLayout(tp_rank=tp_rank, tp_size=tp_size, num_heads=num_heads // tp_size, num_kv_heads=stop - start)


def shard_layer_specs(layers: Sequence[AttentionLayerSpec], layout: TPLayout) -> list[AttentionLayerSpec]:
    """Each layer's attention as one rank of ``layout`` runs it: its query heads and KV heads, except that an
    MLA latent layer (``latent_kv``) keeps its one latent "KV head" on every rank.

    The latent ``[c_kv, k_rope]`` is what every query head reads, so it is replicated, not split (vLLM's
    DeepseekV2MLAAttention and FlashMLA cache the whole latent on each TP rank); a rank's KV block therefore
    holds ``kv_lora_rank + qk_rope_head_dim`` values per token and layer whatever ``tp_size`` is, while its
    query heads (``num_heads / tp_size``) are what the absorbed attention iterates over. The attention
    backend, the KV budget and ``executor=sim`` size the cache from these specs.
    """
    return [dataclasses.replace(layer, num_heads=layout.num_heads,
                                num_kv_heads=1 if layer.latent_kv else layout.num_kv_heads) for layer in layers]


def meta_model(hf_config: PretrainedConfig, dtype: torch.dtype | None = None,
               attn_implementation: str | None = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on the ``meta`` device (no memory, ~0.1 s); ``hf_config``
    is copied, not modified."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), **kwargs)


def resolved_plan(model: nn.Module) -> dict[str, str]:
    """``model.tp_plan`` with its family's :data:`PLAN_OVERRIDES`, expanded to the model's module names
    (``layers.*`` -> ``layers.3``); entries naming parameters (a fused experts' ``gate_up_proj``) are
    left to their module's style."""
    plan = dict(getattr(model, "tp_plan", None) or {})
    if plan:
        prefix = f"{model.base_model_prefix}."
        plan.update({prefix + key: style for key, style in PLAN_OVERRIDES.get(model.config.model_type, {}).items()})
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
    resolved = {}
    for name, _ in model.named_modules():
        style = next((s for pattern, s in patterns if pattern.fullmatch(name)), None)
        if style is not None:
            resolved[name] = style
    return resolved


def _generic(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


def _static_problems(model: nn.Module, plan: dict[str, str]) -> list[str]:
    """Problems no tp size avoids: family not verified, no plan, styles or embeddings not handled."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if refusal := family_tp_refusal(model.config.model_type):
        return [f"{type(model).__name__} ({model.config.model_type!r}) is not run tensor-parallel: {refusal}; "
                "run it with tensor_parallel_size=1"]
    problems = []
    if not any(model.get_submodule(name) not in (embed, head) for name in plan):
        problems.append(f"{type(model).__name__} defines no tensor-parallel plan for its decoder layers "
                        "(config.base_model_tp_plan): run it with tensor_parallel_size=1")
    if problems:
        return problems
    problems = [f"tp_plan style {style!r} of {_generic(name)} is not supported (supported: {list(SUPPORTED_STYLES)})"
                for name, style in plan.items() if style not in SUPPORTED_STYLES]
    problems += [p for name, style in plan.items() if style == "moe_tp_experts"
                 for p in tp_styles.experts_problems(model.get_submodule(name), model.config.model_type)]
    if not isinstance(embed, nn.Embedding) or (type(embed) is not nn.Embedding and not hasattr(embed, "embed_scale")):
        problems.append(f"input embedding {type(embed).__name__} is neither an nn.Embedding nor a scaled one")
    if type(head) is not nn.Linear:
        problems.append(f"LM head {type(head).__name__} is not an nn.Linear")
    return sorted(set(problems))


def family_tp_refusal(model_type: str) -> str | None:
    """Why the family of ``model_type`` is refused under tensor parallelism, or ``None`` when it is
    verified (its ``ModelFamily.tp`` record; a model type outside the family table is refused)."""
    family = family_of(model_type)
    if family is None:
        return "its model type is not in servelab's family table (servelab models)"
    return None if family.tp == TP_VERIFIED else family.tp


def _split_width(module: nn.Module, style: str, is_kv: bool) -> tuple[str, int] | None:
    """The width ``style`` splits evenly over the ranks (``None``: heads decide, or nothing is split)."""
    if style == "moe_tp_experts":
        return "intermediate features", module.down_proj.shape[-1]
    if not isinstance(module, nn.Linear):
        return None
    if style == "rowwise":
        return "in_features", module.in_features
    if style == "packed_colwise":
        return "out_features / 2", module.out_features // 2
    if style in GATHERED_STYLES or (style == "colwise" and not is_kv):
        return "out_features", module.out_features
    return None


def _size_problems(model: nn.Module, plan: dict[str, str], tp_size: int) -> list[str]:
    """Problems of splitting ``model`` over ``tp_size`` ranks (empty: it splits)."""
    num_heads, num_kv, _ = _heads(model.config)
    problems = []
    if num_heads % tp_size:
        problems.append(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}")
    if num_kv != num_heads and num_kv % tp_size and tp_size % num_kv:  # (as many KV heads as query heads: said above)
        problems.append(f"num_key_value_heads={num_kv} is neither divisible by tensor_parallel_size={tp_size} "
                        "nor a divisor of it (KV heads are split, or replicated when tp is a multiple)")
    if problems:  # the attention projections' widths follow from the heads: no need to list them too
        return problems
    head = model.get_output_embeddings()
    for name, style in plan.items():
        module = model.get_submodule(name)
        split = None if module is head else _split_width(module, style, name.rpartition(".")[2] in KV_PROJECTIONS)
        if split is not None and split[1] % tp_size:
            problems.append(f"{_generic(name)} ({style}): {split[0]}={split[1]} is not divisible "
                            f"by tensor_parallel_size={tp_size}")
    splits_kv = any((n.rpartition(".")[2] in KV_PROJECTIONS and s == "colwise") or s == "qkv_colwise"
                    for n, s in plan.items())
    if tp_size > num_kv and not splits_kv:
        problems.append(f"tensor_parallel_size={tp_size} > num_key_value_heads={num_kv} needs KV replication, "
                        f"but the plan has no colwise {list(KV_PROJECTIONS)} nor a qkv_colwise qkv_proj")
    return sorted(set(problems))


def valid_tp_sizes(model: nn.Module, plan: dict[str, str]) -> list[int]:
    """Every ``tp_size`` in ``1..num_attention_heads`` that splits ``model`` (1 always does)."""
    if _static_problems(model, plan):
        return [1]
    num_heads = _heads(model.config)[0]
    return [1] + [t for t in range(2, num_heads + 1) if not num_heads % t and not _size_problems(model, plan, t)]


def tp_problems(hf_config: PretrainedConfig, tp_size: int) -> list[str]:
    """Why ``hf_config``'s model cannot run with ``tensor_parallel_size=tp_size`` (empty: it can).

    Reads only the config (the model is built on ``meta``), so it runs before any weights load.
    A non-empty answer ends with the sizes that work, e.g. SmolLM2-135M (9 query, 3 KV heads,
    intermediate 1536) at 2: ``... valid tensor_parallel_size values for LlamaForCausalLM: [1, 3]``.
    """
    if not isinstance(tp_size, int) or tp_size < 1:
        return [f"tensor_parallel_size must be a positive integer, got {tp_size!r}"]
    if tp_size == 1:
        return []
    model = meta_model(hf_config)
    plan = resolved_plan(model)
    problems = _static_problems(model, plan) or _size_problems(model, plan, tp_size)
    if problems:
        problems.append(f"valid tensor_parallel_size values for {type(model).__name__}: {valid_tp_sizes(model, plan)}")
    return problems


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _style_module(model: nn.Module, name: str, style: str, dims: RankDims,
                  experts_style: ExpertsStyle | None = None) -> tuple[nn.Module, dict] | None:
    """The module and sources ``style`` gives the planned module ``name`` (``None``: it stays whole)."""
    module = model.get_submodule(name)
    if style in REPLICATED_STYLES:
        return None
    if style == "moe_tp_experts" and experts_style is not None:
        return experts_style(module, name, dims, model.config.model_type)
    if style == "moe_tp_experts":
        return tp_styles.moe_tp_experts(module, dims, model.config.model_type)
    if style == "sharded_norm":
        return tp_styles.sharded_norm(module, name, dims, model.config.model_type in WEIGHT_AFTER_CAST_NORMS)
    if not isinstance(module, nn.Linear):
        return None
    rules = {"colwise": lambda: tp_styles.colwise(module, name, dims), "rowwise": lambda: tp_styles.rowwise(module, dims),
             "packed_colwise": lambda: tp_styles.packed_colwise(module, dims),
             "qkv_colwise": lambda: tp_styles.qkv_colwise(module, dims)}
    return rules.get(style, lambda: tp_styles.gathered(module, dims))()


def _shard_embeddings(model: nn.Module, dims: RankDims, sources: WeightSources) -> None:
    """The vocab-parallel input embedding (Gemma's keeps its scale) and the LM head gathering to the driver."""
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    scale = getattr(embed, "scalar_embed_scale", None)
    new_embed = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, like=embed.weight,
                                       scale=None if scale is None else float(scale), **dims.collective_args())
    sources[f"{names[id(embed)]}.weight"] = (f"{names[id(embed)]}.weight", new_embed.shard)
    tied = head.weight is embed.weight
    new_head = ParallelLMHead(head.in_features, head.out_features, like=head.weight,
                              tied=new_embed if tied else None, **dims.collective_args())
    if not tied:
        sources[f"{names[id(head)]}.linear.weight"] = (f"{names[id(head)]}.weight", new_head.shard)
    _set_module(model, names[id(embed)], new_embed)
    _set_module(model, names[id(head)], new_head)


def _localize_attention(model: nn.Module, layout: TPLayout) -> None:
    """Per-head counts the attention modules keep: ``num_key_value_groups`` (eager/sdpa repeat KV heads
    by it), ``num_key_value_heads``, an MLA module's ``num_heads``, and a per-module config copy with this rank's heads where the
    module reads ``config.num_attention_heads`` to split a fused ``qkv_proj`` (Phi-3; one copy shared by
    the layers, so that a compiled decoder still sees one layer kind)."""
    local_configs: dict[int, Any] = {}
    for module in model.modules():
        if not hasattr(module, "num_key_value_groups"):
            continue
        module.num_key_value_groups = layout.num_heads // layout.num_kv_heads
        if hasattr(module, "num_key_value_heads"):
            module.num_key_value_heads = layout.num_kv_heads
        if hasattr(module, "kv_b_proj"):  # MLA: mla.use_latent_attention views kv_b_proj's rows per local head
            module.num_heads = layout.num_heads
        if hasattr(module, "qkv_proj") and hasattr(module, "config"):
            if id(module.config) not in local_configs:
                local = local_configs[id(module.config)] = copy.copy(module.config)
                local.num_attention_heads, local.num_key_value_heads = layout.num_heads, layout.num_kv_heads
            module.config = local_configs[id(module.config)]


def shard_model(model: nn.Module, tp_rank: int, tp_size: int, group_name: str,
                experts_style: ExpertsStyle | None = None) -> WeightSources:
    """Swap ``model``'s planned layers (on ``meta``) for this rank's tensor-parallel layers, in place.

    Args:
        model: a transformers ``*ForCausalLM`` built on the ``meta`` device; :func:`tp_problems`
            must be empty for ``tp_size``.
        tp_rank, tp_size: this rank and the group size.
        group_name: the TP process group's ``group_name`` (the collectives' handle).
        experts_style: shards ``moe_tp_experts`` modules instead (expert parallelism: whole experts per
            rank, ``expert_parallel.ExpertSharder``); ``None``: split every expert's intermediate features.

    Returns:
        Where each sharded parameter's values come from (params not listed load whole, same name).
    """
    plan = resolved_plan(model)
    dims = RankDims(tp_rank, tp_size, group_name, *_heads(model.config))
    sources: WeightSources = {}
    _shard_embeddings(model, dims, sources)
    for name, style in plan.items():
        swapped = _style_module(model, name, style, dims, experts_style)
        if swapped is None:
            continue
        new, local = swapped
        sources.update({f"{name}.{param}": (f"{name}.{key}".rstrip("."), shard) for param, (key, shard) in local.items()})
        _set_module(model, name, new)
    _localize_attention(model, rank_layout(model.config, tp_rank, tp_size))
    return sources


def linear_shapes(hf_config: PretrainedConfig, tp_size: int) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` one rank's decoder linears hold under ``tp_size``, by name with
    layer numbers as ``*`` (``model.layers.*.mlp.down_proj``); a wrapper's inner shard is listed
    under the wrapper's name. For quant methods' pre-load checks (:meth:`QuantMethod.validate_tp`).

    Raises:
        ValueError: ``tp_problems(hf_config, tp_size)`` is not empty.
    """
    if problems := tp_problems(hf_config, tp_size):
        raise ValueError("; ".join(problems))
    model = meta_model(hf_config)
    if tp_size > 1:
        shard_model(model, 0, tp_size, group_name="")
    decoder = model.get_decoder()
    return {_generic(f".{name}.").strip(".").removesuffix(".linear"): (m.in_features, m.out_features)
            for name, m in decoder.named_modules() if isinstance(m, nn.Linear)}
