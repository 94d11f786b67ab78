"""Pipeline parallelism's model side: which decoder layers a stage owns, and the stage's model.

``parallel.pipeline_parallel_size=N`` cuts the decoder into N stages of consecutive layers (vLLM's
``get_pp_indices``; ``parallel.pp_layer_partition="3,2"`` overrides the split as vLLM's
``VLLM_PP_LAYER_PARTITION`` does). A stage keeps the unmodified transformers model but replaces what it does
not run with :class:`PPMissingLayer`, an identity stand-in (vLLM's ``PPMissingLayer``): the other stages'
decoder layers, the input embedding on every stage but the first, the final norm and the LM head on every
stage but the last. Which modules those are comes from the model config's ``base_model_pp_plan``
(transformers': ``{"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states", ...],
["hidden_states"]), "norm": (["hidden_states"], ["hidden_states"])}``); a model without one is refused.

The stage hand-off is the decoder's hidden state ``(1, num_tokens, hidden_size)``: transformers' decoder layers
add their residual inside the layer, so the residual vLLM passes beside the hidden state is already in it. A
stage after the first feeds it back as ``inputs_embeds`` (rotary embeddings are recomputed from
``position_ids``, which every stage has).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: model types whose PP split is checked token for token against transformers (tests/plugins/executors/
#: test_mp_pipeline.py); others are refused until verified
PP_VERIFIED_MODEL_TYPES = ("llama",)


class PPMissingLayer(nn.Identity):
    """A module this stage does not run (vLLM's ``PPMissingLayer``): returns its first input unchanged,
    holds no parameters, so the stage neither loads nor keeps the weights of the module it replaces."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first positional argument, else the first keyword argument's value."""
        return args[0] if args else next(iter(kwargs.values()))


def parse_partition(partition: str | None, num_layers: int, pp_size: int) -> list[int] | None:
    """Layers per stage from ``parallel.pp_layer_partition`` (``"3,2"``), or ``None`` when unset (``""``).

    Raises:
        ValueError: not ``pp_size`` comma-separated positive integers summing to ``num_layers`` (names the fix).
    """
    if not partition:
        return None
    try:
        parts = [int(p) for p in str(partition).split(",")]
    except ValueError:
        raise ValueError(f"parallel.pp_layer_partition={partition!r} must be comma-separated integers, "
                         f"one per stage (e.g. \"3,2\")") from None
    if len(parts) != pp_size or any(p < 1 for p in parts) or sum(parts) != num_layers:
        raise ValueError(f"parallel.pp_layer_partition={partition!r} must give {pp_size} positive layer counts "
                         f"(one per stage of pipeline_parallel_size={pp_size}) summing to the model's "
                         f"{num_layers} layers")
    return parts


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int, partition: str | None = None) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers stage ``pp_rank`` owns (vLLM's ``get_pp_indices``): equal
    shares, the remainder going one layer each to the stages before the last, counting back from the
    second-to-last (the last stage also runs the norm and LM head), or ``partition``'s counts
    (:func:`parse_partition`).

    Raises:
        ValueError: ``pp_size`` more than ``num_layers`` (a stage would own no layer), ``pp_rank`` outside
            ``[0, pp_size)``, or a bad ``partition``.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} decoder layers; "
                         f"use at most {num_layers} stages")
    parts = parse_partition(partition, num_layers, pp_size)
    if parts is None:
        parts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def pp_problems(hf_config: Any, pp_size: int, partition: str | None = None) -> list[str]:
    """Why the model cannot be split into ``pp_size`` stages (empty: it can), from its config alone.

    Refused: a family not verified under pipeline parallelism (:data:`PP_VERIFIED_MODEL_TYPES`), a model
    without ``base_model_pp_plan``, MLA, more stages than decoder layers, a bad ``pp_layer_partition``.
    """
    if pp_size <= 1:
        return []
    model_type = getattr(hf_config, "model_type", "?")
    problems = []
    if model_type not in PP_VERIFIED_MODEL_TYPES:
        problems.append(f"pipeline_parallel_size={pp_size}: model_type {model_type!r} is not verified under "
                        f"pipeline parallelism (verified: {list(PP_VERIFIED_MODEL_TYPES)}); use "
                        "tensor_parallel_size instead")
    if not _plan_modules(hf_config):
        problems.append(f"pipeline_parallel_size={pp_size}: {model_type} has no base_model_pp_plan of "
                        "embedding, layers and norm, so servelab cannot tell which modules a stage runs")
    if getattr(hf_config, "qk_nope_head_dim", None) and getattr(hf_config, "v_head_dim", None):
        problems.append(f"pipeline_parallel_size={pp_size}: MLA (latent attention) models are not split into stages")
    num_layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    try:
        get_pp_indices(num_layers, 0, pp_size, partition)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def pipeline_refusals(config: Any) -> list[str]:
    """What an executor refuses before any rank starts when ``config.pipeline_parallel_size > 1`` (empty:
    nothing, or one stage): speculative decoding, LoRA, ``engine.compile=true`` and expert parallelism (none is
    wired through the stages yet; a KV connector is, ``framework/engine/kv_transfer_support.py`` refuses the rest),
    then the model's own reasons (:func:`pp_problems`, from its ``config.json``; a model that cannot be read is left
    to the builder's ``inspect_model``)."""
    pp = config.pipeline_parallel_size
    if pp <= 1:
        return []
    problems = []
    for on, what, fix in ((config.drafter != "none", f"spec_decode={config.drafter}", "spec_decode=none"),
                          (config.enable_lora, "lora.enable=true", "lora.enable=false"),
                          (config.compile == "true", "engine.compile=true", "engine.compile=false"),
                          (getattr(config, "enable_expert_parallel", False), "parallel.enable_expert_parallel=true",
                           "parallel.enable_expert_parallel=false")):
        if on:
            problems.append(f"pipeline_parallel_size={pp} does not run with {what} yet: use {fix}, or "
                            "parallel.pipeline_parallel_size=1 (tensor_parallel_size shards the model instead)")
    from framework.model_executor.model_loader import load_model_config

    try:
        hf_config = load_model_config(config.model)
    except (OSError, ValueError, ModuleNotFoundError):
        return problems
    return problems + pp_problems(hf_config, pp, config.pp_layer_partition)


def _plan_modules(hf_config: Any) -> tuple[str, str, str] | None:
    """``(embedding, layers, norm)`` module names of the base model from ``base_model_pp_plan``: the entry
    that takes ``input_ids``, the one that outputs ``hidden_states`` from ``hidden_states`` and is a list
    (the first such), and the last entry; ``None`` when the plan does not have that shape."""
    plan = getattr(hf_config, "base_model_pp_plan", None) or {}
    names = list(plan)
    if len(names) != 3 or "input_ids" not in plan[names[0]][0] or "hidden_states" not in plan[names[1]][0]:
        return None
    return names[0], names[1], names[2]


def split_stage(model: nn.Module, pp_rank: int, pp_size: int, partition: str | None = None) -> tuple[int, int]:
    """Make ``model`` (a loaded ``*ForCausalLM``) stage ``pp_rank``'s: the layers it does not own, the
    embedding (not the first stage), the final norm and LM head (not the last stage) become
    :class:`PPMissingLayer` and their parameters are released. Layers keep their global index (attention's
    ``layer_idx``, the KV cache's).

    Returns:
        ``[start, end)`` of the layers this stage runs.

    Raises:
        ValueError: :func:`pp_problems` is not empty.
    """
    config = model.config
    if problems := pp_problems(config, pp_size, partition):
        raise ValueError("; ".join(problems))
    start, end = get_pp_indices(config.num_hidden_layers, pp_rank, pp_size, partition)
    embed_name, layers_name, norm_name = _plan_modules(config)
    base = model.get_decoder()
    layers = getattr(base, layers_name)
    for i in range(len(layers)):
        if not start <= i < end:
            layers[i] = PPMissingLayer()
    if pp_rank > 0:
        setattr(base, embed_name, PPMissingLayer())
    if pp_rank < pp_size - 1:
        setattr(base, norm_name, PPMissingLayer())
        model.set_output_embeddings(PPMissingLayer())
    return start, end


def stage_kv_slots(layout: Any, start: int, end: int) -> list[int]:
    """The KV tensors a stage running layers ``[start, end)`` allocates, ascending: the layout slots
    (``KVCacheLayout.tensor_of_layer``) of those layers; the block count the driver sizes then counts only
    these tensors' bytes per block (``Worker.kv_cache_bytes_per_block``)."""
    of_layer = layout.tensor_of_layer()
    return sorted({of_layer[i] for i in range(start, end)})


def stage_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None,
                  attention_mask: Any) -> torch.Tensor:
    """One stage's decoder: from ``input_ids (1, num_tokens) int64`` on the first stage, else from the previous
    stage's ``hidden (1, num_tokens, hidden_size)`` in the model dtype (as ``inputs_embeds``).

    Returns:
        ``(1, num_tokens, hidden_size)``: the hand-off to the next stage, or (last stage) the normed hidden
        states the LM head reads.
    """
    decoder = model.get_decoder()
    if hidden is None:
        out = decoder(input_ids=input_ids, position_ids=positions, use_cache=False, attention_mask=attention_mask)
    else:
        out = decoder(inputs_embeds=hidden, position_ids=positions, use_cache=False, attention_mask=attention_mask)
    return out.last_hidden_state
