"""Tensor parallelism for unmodified transformers models, driven by the model's own ``tp_plan``.

The way vLLM's Transformers modeling backend does it (``recursive_replace``): the model is built on
the ``meta`` device, every ``nn.Linear`` leaf its plan names is swapped for a tensor-parallel layer
(``framework/model_executor/parallel_layers.py``), the input embedding is vocab-parallel and the LM head
gathers logits to the driver; then each rank reads only its slices of the safetensors checkpoint
(``framework/model_executor/tp_weights.py``). The model code itself is untouched.

Plan styles (transformers' names, ``model.tp_plan`` = ``config.base_model_tp_plan`` + the head's):
``colwise`` (output features split), ``rowwise`` (input features split, all-reduce),
``colwise_rep`` / ``colwise_gather_output`` (split then all-gathered; on the LM head: gathered to
the driver only), ``embedding_rowwise`` (vocab-parallel embedding, applied whether or not the plan
names it, as vLLM does), ``replicated_with_grad_allreduce`` / ``replicate`` (kept whole: per-head
norms). Any other style is refused by :func:`tp_problems`.

Heads: rank ``r`` holds query heads ``[r * H / tp, (r + 1) * H / tp)``. KV heads are split the same
way when ``tp`` divides their count ``K``; when ``tp`` is a multiple of ``K`` each KV head is
replicated on ``tp / K`` consecutive ranks (rank ``r`` holds KV head ``r // (tp / K)``, vLLM's
``QKVParallelLinear`` rule), which is the KV head its query heads attend to.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from framework.model_executor.parallel_layers import (
    GatheredColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    even_range,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


#: ``config.model_type`` values whose attention code was checked under TP (reshapes with ``-1``
#: heads, ``num_key_value_groups`` the only per-head count it keeps) and that the tests run.
VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GATHERED_STYLES = ("colwise_rep", "colwise_gather_output")
REPLICATED_STYLES = ("replicated_with_grad_allreduce", "replicate")
SUPPORTED_STYLES = ("colwise", "rowwise", "embedding_rowwise", *GATHERED_STYLES, *REPLICATED_STYLES)
KV_PROJECTIONS = ("k_proj", "v_proj")  # colwise leaves holding KV heads (replicated when tp > K)

#: param name in the sharded model -> (tensor name in the checkpoint, this rank's slice or None: whole)
WeightSources = dict[str, tuple[str, Shard | None]]


@dataclass
class TPLayout:
    """What one tensor-parallel rank holds; the attention backend and KV cache are sized from it."""

    tp_rank: int  # this rank in the TP group, 0 = driver
    tp_size: int  # ranks in the TP group
    num_heads: int  # query heads on this rank: num_attention_heads / tp_size
    num_kv_heads: int  # KV heads on this rank: num_key_value_heads / tp_size, or 1 when replicated


def _heads(hf_config: PretrainedConfig) -> tuple[int, int, int]:
    text = hf_config.get_text_config()
    num_heads = int(text.num_attention_heads)
    num_kv = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
    return num_heads, num_kv, head_dim


def kv_head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of the KV heads rank ``tp_rank`` holds (see the module docstring)."""
    if tp_size <= num_kv_heads:
        return even_range(num_kv_heads, tp_rank, tp_size)
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1


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
    """``model.tp_plan`` expanded to the model's module names (``layers.*`` -> ``layers.3``)."""
    plan = dict(getattr(model, "tp_plan", None) or {})
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
    problems = []
    if not any(model.get_submodule(name) not in (embed, head) for name in plan):
        problems.append(f"{type(model).__name__} defines no tensor-parallel plan for its decoder layers "
                        "(config.base_model_tp_plan): run it with tensor_parallel_size=1")
    kind = model.config.model_type
    if kind not in VERIFIED_MODEL_TYPES:
        problems.append(f"tensor parallelism is verified for model types {list(VERIFIED_MODEL_TYPES)}, not {kind!r} "
                        f"({type(model).__name__}): run it with tensor_parallel_size=1")
    if problems:
        return problems
    problems = [f"tp_plan style {style!r} of {_generic(name)} is not supported (supported: {list(SUPPORTED_STYLES)})"
                for name, style in plan.items() if style not in SUPPORTED_STYLES]
    if type(embed) is not nn.Embedding:
        problems.append(f"input embedding {type(embed).__name__} is not an nn.Embedding")
    if type(head) is not nn.Linear:
        problems.append(f"LM head {type(head).__name__} is not an nn.Linear")
    return sorted(set(problems))


def _size_problems(model: nn.Module, plan: dict[str, str], tp_size: int) -> list[str]:
    """Problems of splitting ``model`` over ``tp_size`` ranks (empty: it splits)."""
    num_heads, num_kv, _ = _heads(model.config)
    problems = []
    if num_heads % tp_size:
        problems.append(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={tp_size}")
    if num_kv % tp_size and tp_size % num_kv:
        problems.append(f"num_key_value_heads={num_kv} is neither divisible by tensor_parallel_size={tp_size} "
                        "nor a divisor of it (KV heads are split, or replicated when tp is a multiple)")
    if problems:  # the attention projections' widths follow from the heads: no need to list them too
        return problems
    head = model.get_output_embeddings()
    for name, style in plan.items():
        module = model.get_submodule(name)
        if module is head or not isinstance(module, nn.Linear):
            continue
        is_kv = name.rpartition(".")[2] in KV_PROJECTIONS
        if style == "rowwise" and module.in_features % tp_size:
            problems.append(f"{_generic(name)} (rowwise): in_features={module.in_features} is not divisible "
                            f"by tensor_parallel_size={tp_size}")
        elif (style in GATHERED_STYLES or (style == "colwise" and not is_kv)) and module.out_features % tp_size:
            problems.append(f"{_generic(name)} ({style}): out_features={module.out_features} is not divisible "
                            f"by tensor_parallel_size={tp_size}")
    if tp_size > num_kv and not any(n.rpartition(".")[2] in KV_PROJECTIONS and s == "colwise" for n, s in plan.items()):
        problems.append(f"tensor_parallel_size={tp_size} > num_key_value_heads={num_kv} needs KV replication, "
                        f"but the plan has no colwise {list(KV_PROJECTIONS)}")
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


def _colwise(linear: nn.Linear, name: str, tp_rank: int, tp_size: int, head_dim: int,
             num_kv: int) -> tuple[nn.Linear, Shard]:
    """A plain ``nn.Linear`` holding this rank's output rows (KV projections: its KV heads' rows)."""
    if name.rpartition(".")[2] in KV_PROJECTIONS:
        first, last = kv_head_range(num_kv, tp_rank, tp_size)
        start, stop = first * head_dim, last * head_dim
    else:
        start, stop = even_range(linear.out_features, tp_rank, tp_size)
    shard = nn.Linear(linear.in_features, stop - start, bias=linear.bias is not None, device="meta",
                      dtype=linear.weight.dtype)
    return shard, Shard(0, start, stop, stop - start)


def shard_model(model: nn.Module, tp_rank: int, tp_size: int, group_name: str) -> WeightSources:
    """Swap ``model``'s planned layers (on ``meta``) for this rank's tensor-parallel layers, in place.

    Args:
        model: a transformers ``*ForCausalLM`` built on the ``meta`` device; :func:`tp_problems`
            must be empty for ``tp_size``.
        tp_rank, tp_size: this rank and the group size.
        group_name: the TP process group's ``group_name`` (the collectives' handle).

    Returns:
        Where each sharded parameter's values come from (params not listed load whole, same name).
    """
    plan = resolved_plan(model)
    num_heads, num_kv, head_dim = _heads(model.config)
    dims = {"tp_rank": tp_rank, "tp_size": tp_size, "group_name": group_name}
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    sources: WeightSources = {}
    new_embed = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim, like=embed.weight, **dims)
    sources[f"{names[id(embed)]}.weight"] = (f"{names[id(embed)]}.weight", new_embed.shard)
    tied = head.weight is embed.weight
    new_head = ParallelLMHead(head.in_features, head.out_features, like=head.weight,
                              tied=new_embed if tied else None, **dims)
    if not tied:
        sources[f"{names[id(head)]}.linear.weight"] = (f"{names[id(head)]}.weight", new_head.shard)
    _set_module(model, names[id(embed)], new_embed)
    _set_module(model, names[id(head)], new_head)
    for name, style in plan.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear) or style in REPLICATED_STYLES:
            continue
        bias = module.bias is not None
        if style == "colwise":
            new, shard = _colwise(module, name, tp_rank, tp_size, head_dim, num_kv)
            sources[f"{name}.weight"] = (f"{name}.weight", shard)
            if bias:
                sources[f"{name}.bias"] = (f"{name}.bias", Shard(0, shard.start, shard.stop, shard.size))
        elif style == "rowwise":
            new = RowParallelLinear(module.in_features, module.out_features, bias, like=module.weight, **dims)
            sources[f"{name}.linear.weight"] = (f"{name}.weight", new.shard)
        else:  # gathered
            new = GatheredColumnParallelLinear(module.in_features, module.out_features, bias, like=module.weight,
                                               **dims)
            sources[f"{name}.linear.weight"] = (f"{name}.weight", new.shard)
            if bias:
                sources[f"{name}.linear.bias"] = (f"{name}.bias", Shard(0, new.shard.start, new.shard.stop,
                                                                        new.shard.size))
        _set_module(model, name, new)
    layout = rank_layout(model.config, tp_rank, tp_size)
    for module in model.modules():  # eager/sdpa attention repeat KV heads by this ratio
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = layout.num_heads // layout.num_kv_heads
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
