"""Reading LoRA adapters as PEFT saves them (``adapter_config.json`` + ``adapter_model.safetensors``).

An adapter is checked against the base model's linears by name and shape, before it is used: on the driver when
the first request naming it arrives (``framework/engine/processor.py``: a bad adapter fails that ``add_request``
and nothing else), and again by each rank that loads it (``framework/model_executor/lora_layers.py``). The
scale is PEFT's: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski, "A Rank
Stabilization Scaling Factor for Fine-Tuning with LoRA", 2023).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from framework.core.lora_request import LoRARequest

#: the projections a LoRA adapter may target (Llama-style names, as PEFT's ``target_modules`` spell them)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoRAAdapter:
    """One adapter's weights, on the CPU, in the model's dtype."""

    lora_int_id: int  # LoRARequest.lora_int_id
    rank: int  # r of adapter_config.json
    scale: float  # lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))
    # module name (as in model.named_modules()) -> (A (r, in_features), B (out_features, r))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def module_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of every LoRA-targetable linear of a Llama-style decoder, by module name
    (``model.layers.<i>.self_attn.q_proj``...), from ``config.json`` alone (the driver holds no weights)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    per_layer = {"self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv_heads * head_dim),
                 "self_attn.v_proj": (hidden, kv_heads * head_dim), "self_attn.o_proj": (heads * head_dim, hidden),
                 "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    return {f"model.layers.{i}.{name}": shape for i in range(hf_config.num_hidden_layers)
            for name, shape in per_layer.items()}


def read_adapter_config(lora_request: LoRARequest, max_lora_rank: int) -> tuple[int, float]:
    """``(rank, scale)`` of the adapter at ``lora_request.lora_path``.

    Raises:
        ValueError: a missing folder or config, unparsable JSON, a rank above ``max_lora_rank`` (names
            ``lora.max_lora_rank``), or PEFT options this engine does not apply (DoRA, biases, per-module rank or
            alpha patterns, ``modules_to_save``, ``fan_in_fan_out``).
    """
    where = f"LoRA adapter {lora_request.lora_name!r} ({lora_request.lora_path})"
    path = Path(lora_request.lora_path) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE}; lora_path must be a folder saved by PEFT's save_pretrained")
    try:
        cfg = json.loads(path.read_text())
        rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not a PEFT LoRA config ({type(e).__name__}: {e}); "
                         "re-save the adapter with PEFT") from e
    unsupported = [name for name, bad in (
        ("use_dora", cfg.get("use_dora")), ("bias", cfg.get("bias", "none") != "none"),
        ("rank_pattern", cfg.get("rank_pattern")), ("alpha_pattern", cfg.get("alpha_pattern")),
        ("modules_to_save", cfg.get("modules_to_save")), ("fan_in_fan_out", cfg.get("fan_in_fan_out"))) if bad]
    if unsupported:
        raise ValueError(f"{where}: PEFT options {unsupported} are not supported; train the adapter without them "
                         "(plain LoRA, bias='none')")
    if not 1 <= rank <= max_lora_rank:
        raise ValueError(f"{where}: rank {rank} exceeds lora.max_lora_rank={max_lora_rank}; raise max_lora_rank "
                         f"to at least {rank} (LLM(max_lora_rank=...))")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scale


def load_adapter(lora_request: LoRARequest, shapes: dict[str, tuple[int, int]], max_lora_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Read and check one adapter; its weights come back on the CPU in ``dtype``.

    Args:
        shapes: the base model's targetable linears, ``(in_features, out_features)`` by module name
            (:func:`module_shapes`, or the wrapped model's).
        max_lora_rank: the largest rank accepted.

    Raises:
        ValueError: :func:`read_adapter_config`'s errors; a missing or corrupt ``adapter_model.safetensors``; a
            weight for a module the model does not have (or does not support: embeddings, the LM head); shapes
            that do not fit the base model (an adapter trained for another model).
    """
    from safetensors.torch import load_file

    rank, scale = read_adapter_config(lora_request, max_lora_rank)
    where = f"LoRA adapter {lora_request.lora_name!r} ({lora_request.lora_path})"
    path = Path(lora_request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{where}: no {WEIGHTS_FILE}; save the adapter with PEFT (safe_serialization=True)")
    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read ({type(e).__name__}: {e}); re-save it") from e
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        for half in ("lora_A", "lora_B"):
            if name.endswith(f".{half}.weight"):
                halves.setdefault(name[:-len(f".{half}.weight")], {})[half] = tensor
                break
        else:
            raise ValueError(f"{where}: weight {key!r} is not a LoRA A/B matrix of a linear; only "
                             f"{', '.join(TARGET_MODULES)} can be adapted")
    weights = {}
    for module, pair in halves.items():
        weights[module] = _checked_pair(where, module, pair, shapes, rank, dtype)
    if not weights:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(lora_request.lora_int_id, rank, scale, weights)


def _checked_pair(where: str, module: str, pair: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]],
                  rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of one module, checked against the base model's linear and the adapter's rank."""
    if module not in shapes:
        leaf = module.rsplit(".", 1)[-1]
        fix = (f"target only {', '.join(TARGET_MODULES)}" if leaf not in TARGET_MODULES
               else "the adapter was trained for another base model (more layers); use this model's adapter")
        raise ValueError(f"{where}: the base model has no LoRA-targetable module {module!r}; {fix}")
    if set(pair) != {"lora_A", "lora_B"}:
        raise ValueError(f"{where}: module {module!r} lacks its {({'lora_A', 'lora_B'} - set(pair)).pop()} weight; "
                         "the file is incomplete, re-save the adapter")
    a, b = pair["lora_A"], pair["lora_B"]
    in_features, out_features = shapes[module]
    if a.shape != (rank, in_features) or b.shape != (out_features, rank):
        raise ValueError(f"{where}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this base model needs "
                         f"A ({rank}, {in_features}) and B ({out_features}, {rank}); the adapter was trained for "
                         "another base model")
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()
