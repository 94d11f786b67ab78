"""One tensor-parallel rank's weights: only its slices of the safetensors checkpoint are read.

The sharded model (``framework/model_executor/tensor_parallel.py``) is still on the ``meta`` device; each
parameter is filled from ``safe_open(...).get_slice(name)[rows]`` (or ``[:, cols]``), which copies
just that slice out of the memory-mapped file, so no rank ever holds a sharded layer's full weight.
Non-persistent buffers (RoPE's ``inv_freq``) are computed by the model's own ``_init_weights``, as
transformers does when it loads from ``meta``.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.distributed.parallel_state import ensure_model_parallel_initialized
from framework.model_executor.model_loader import DTYPES, LoadedModel, eos_token_ids, load_model, resolve_model_path
from framework.model_executor.parallel_layers import PackedShard, Shard
from framework.model_executor.tensor_parallel import WeightSources, meta_model, shard_model, tp_problems
from framework.model_executor.tp_styles import ExpertSlices

#: model_type -> (pattern, replacement) of module names in the model to tensor names in checkpoints,
#: tried when a name is not in the checkpoint (transformers renames these while loading,
#: ``conversion_mapping.py``): Mixtral's MoE block, GPT-NeoX's head.
CHECKPOINT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((r"\.mlp\.", ".block_sparse_moe."),), "gpt_neox": ((r"^lm_head\.", "embed_out."),)}


def safetensors_index(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the ``*.safetensors`` file holding it (``model.safetensors.index.json`` if present).

    Raises:
        FileNotFoundError: no safetensors file in ``path`` (e.g. only ``pytorch_model.bin``).
    """
    from safetensors import safe_open

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file: tensor-parallel loading reads slices of "
                                "safetensors weights (re-save the model with save_pretrained(safe_serialization=True))")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.update(dict.fromkeys(handle.keys(), file))
    return names


def checkpoint_name(name: str, index: dict[str, Path], model_type: str, prefix: bool = False) -> str:
    """``name`` as the checkpoint spells it: itself, or renamed by :data:`CHECKPOINT_RENAMES`; with
    ``prefix``, a fused experts' module name, found by its first expert's tensors (``<name>.0.*``)."""
    for pattern, replacement in ((None, None), *CHECKPOINT_RENAMES.get(model_type, ())):
        key = name if pattern is None else re.sub(pattern, replacement, name)
        if key in index or (prefix and any(k.startswith(f"{key}.0.") for k in index)):
            return key
    return name


def read_experts(open_file: Any, key: str, slices: ExpertSlices, index: dict[str, Path]) -> torch.Tensor:
    """A fused experts parameter from per-expert tensors ``<key>.<e>.<leaf>.weight`` (see :class:`ExpertSlices`).

    Raises:
        FileNotFoundError: an expert's tensor is not in the checkpoint.
    """
    experts = []
    for e in slices.ids():
        parts = []
        for leaf in slices.leaves:
            name = f"{key}.{e}.{leaf}.weight"
            if name not in index:
                raise FileNotFoundError(f"no tensor {name!r} in the checkpoint (fused experts are read per expert)")
            parts.append(read_slice(open_file(index[name]), name, slices.shard))
        experts.append(torch.cat(parts, dim=0))
    return torch.stack(experts)


def read_slice(handle: Any, name: str, shard: Shard | PackedShard | None) -> torch.Tensor:
    """The ``shard`` of tensor ``name`` from an open ``safe_open`` handle (whole when ``shard`` is None),
    zero-padded to ``shard.size`` along ``shard.dim`` (a :class:`PackedShard`: its sections read so and
    concatenated along their dim); on CPU in the checkpoint's dtype."""
    if shard is None:
        return handle.get_tensor(name)
    if isinstance(shard, PackedShard):
        return torch.cat([read_slice(handle, name, section) for section in shard.sections], dim=shard.dim)
    part = handle.get_slice(name)
    values = part[(slice(None),) * shard.dim + (slice(shard.start, shard.stop),)]
    missing = shard.size - (shard.stop - shard.start)
    if missing:
        pad_shape = list(values.shape)
        pad_shape[shard.dim] = missing
        values = torch.cat([values, values.new_zeros(pad_shape)], dim=shard.dim)
    return values


def load_weights(model: nn.Module, path: str | Path, sources: WeightSources, device: torch.device,
                 pre_quantized: bool = False) -> None:
    """Materialise every ``meta`` parameter of ``model`` on ``device`` from the checkpoint in ``path``.

    Parameters keep their (meta) dtype and shape; tied parameters are filled once and stay shared; persistent
    buffers the checkpoint holds are read whole, the others computed (:func:`_init_buffers`). With
    ``pre_quantized`` (``config.json`` has a ``quantization_config``) a weight the file lacks is left zero: it
    is a packed layer's, which the quant method replaces (and refuses a layer whose file holds neither).

    Raises:
        FileNotFoundError: a parameter's tensor is not in the checkpoint.
        ValueError: a slice's shape differs from the parameter's.
    """
    from safetensors import safe_open

    index = safetensors_index(path)
    model_type = model.config.model_type
    filled: dict[int, nn.Parameter] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def open_file(file: Path) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            return handles[file]

        for name, param in model.named_parameters():
            key, shard = sources.get(name, (name, None))
            key = checkpoint_name(key, index, model_type, prefix=isinstance(shard, ExpertSlices))
            if isinstance(shard, ExpertSlices):
                values = read_experts(open_file, key, shard, index)
            elif key not in index and pre_quantized:
                values = torch.zeros(param.shape, dtype=param.dtype)
            elif key not in index:
                raise FileNotFoundError(f"{path}: no tensor {key!r} in the checkpoint for parameter {name!r}")
            else:
                values = read_slice(open_file(index[key]), key, shard)
            if values.shape != param.shape:
                raise ValueError(f"{path}: {key} gives {tuple(values.shape)} for {name} of shape {tuple(param.shape)}")
            filled[id(param)] = nn.Parameter(values.to(device=device, dtype=param.dtype), requires_grad=False)
        buffers = _checkpoint_buffers(model, index, model_type, open_file, device)
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None and id(param) in filled:
                module._parameters[attr] = filled[id(param)]
        for attr, buf in module._buffers.items():
            if buf is not None and id(buf) in buffers:
                module._buffers[attr] = buffers[id(buf)]
    _init_buffers(model, device)


def _checkpoint_buffers(model: nn.Module, index: dict[str, Path], model_type: str, open_file: Any,
                        device: torch.device) -> dict[int, torch.Tensor]:
    """Persistent ``meta`` buffers the checkpoint holds (DeepSeek-V3's router ``e_score_correction_bias``),
    read whole in the buffer's dtype: id of the meta buffer -> its values on ``device``.

    Raises:
        ValueError: a buffer's tensor has another shape than the buffer.
    """
    values: dict[int, torch.Tensor] = {}
    for name, buf in model.named_buffers():
        key = checkpoint_name(name, index, model_type)
        if not buf.is_meta or key not in index:
            continue
        tensor = read_slice(open_file(index[key]), key, None)
        if tensor.shape != buf.shape:
            raise ValueError(f"{key} gives {tuple(tensor.shape)} for buffer {name} of shape {tuple(buf.shape)}")
        values[id(buf)] = tensor.to(device=device, dtype=buf.dtype)
    return values


def _init_buffers(model: nn.Module, device: torch.device) -> None:
    """Allocate ``meta`` buffers on ``device`` and let the model's ``_init_weights`` compute them.

    Raises:
        RuntimeError: a buffer's module also owns parameters (``_init_weights`` would reset them), or
            a parameter or buffer is still on ``meta`` afterwards.
    """
    for name, module in model.named_modules():
        metas = [attr for attr, buf in module._buffers.items() if buf is not None and buf.is_meta]
        if not metas:
            continue
        if next(module.parameters(recurse=False), None) is not None:
            raise RuntimeError(f"cannot compute buffers {metas} of {name!r}: its module also has parameters")
        for attr in metas:
            module._buffers[attr] = torch.empty_like(module._buffers[attr], device=device)
        model._init_weights(module)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left on the meta device after loading: {left[:5]}")


def load_sharded_model(model: str, dtype: torch.dtype, device: torch.device, tp_rank: int, tp_size: int,
                       attn_implementation: str, group_name: str) -> LoadedModel:
    """Build ``model`` on ``meta``, shard it for ``tp_rank`` and read its slices (``load_tp_model``'s body).

    Raises:
        ValueError: ``tp_problems`` is not empty; FileNotFoundError: see :func:`load_weights`.
    """
    from transformers import AutoConfig

    path = resolve_model_path(model)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if problems := tp_problems(config, tp_size):
        raise ValueError("; ".join(problems))
    pre_quantized = getattr(config, "quantization_config", None) is not None
    if pre_quantized:  # built without transformers' quantizer, as load_model does; the quant method reads the file
        del config.quantization_config
    net = meta_model(config, dtype=dtype, attn_implementation=attn_implementation)
    sources = shard_model(net, tp_rank, tp_size, group_name)
    load_weights(net, path, sources, device, pre_quantized)
    if pre_quantized:  # where each sharded linear's slice comes from: the checkpoint quant method shards its layers
        net.tp_weight_sources, net.tp_world_size = sources, tp_size
    net.eval().requires_grad_(False)
    return loaded_sharded_model(net, path)


def loaded_sharded_model(net: nn.Module, path: str) -> LoadedModel:
    """``net`` (a rank's sharded model, weights loaded) as a :class:`LoadedModel`: the folder's
    ``generation_config.json`` when it has one, its tokenizer, EOS ids and ``max_position_embeddings`` (tokens).

    Raises:
        OSError: the folder has no tokenizer.
    """
    from transformers import AutoTokenizer, GenerationConfig

    with contextlib.suppress(OSError):  # a folder without generation_config.json keeps from_config's
        net.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model=net, tokenizer=tokenizer, config=net.config,
                       eos_token_ids=eos_token_ids(net.generation_config, net.config, tokenizer),
                       max_model_len=int(net.config.max_position_embeddings), path=path)


def load_tp_model(model: str, dtype: str, device: str, tp_rank: int, tp_size: int,
                  attn_implementation: str) -> LoadedModel:
    """Load this rank's shard of ``model`` (see :func:`framework.model_executor.model_loader.resolve_model_path`).

    Runs in every rank of a TP group with ``torch.distributed`` initialised (gloo on CPU, nccl on
    CUDA); the layers get their group from :func:`framework.distributed.parallel_state.get_tp_group`
    (the worker made it; otherwise ``ensure_model_parallel_initialized`` makes the world the TP
    group, with torch.distributed's collectives). The model is built on ``meta``, sharded by its plan,
    and only this rank's slices are read from the safetensors files. ``tp_size == 1`` is
    :func:`~framework.model_executor.model_loader.load_model`.

    Args:
        model, dtype, device, attn_implementation: as ``load_model`` (``device``: this rank's).
        tp_rank, tp_size: this rank and the group size.

    Returns:
        A ``LoadedModel`` whose ``model(...)`` returns the full ``(..., vocab)`` logits on the driver
        (``tp_rank == 0``) and ``(..., 0)`` logits on every other rank (which must not sample);
        hidden states are whole (replicated) on every rank; ``config`` is the full model's.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, or the TP group does not match
            ``tp_rank``/``tp_size``.
        ValueError: ``tp_problems`` is not empty (names the valid sizes), unknown ``dtype``.
        FileNotFoundError: the folder holds no ``*.safetensors`` weights, or one lacks a tensor.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if tp_size == 1:
        return load_model(model, dtype=dtype, device=device, attn_implementation=attn_implementation)
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("load_tp_model needs torch.distributed initialised (the executor's worker does it)")
    if (dist.get_rank(), dist.get_world_size()) != (tp_rank, tp_size):
        raise RuntimeError(f"default process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"asked for tp_rank={tp_rank} of tp_size={tp_size}")
    # a group the worker did not make (tests, scripts) keeps torch.distributed's collectives, as before issue 49
    group = ensure_model_parallel_initialized(tp_size, torch.device(device).type, communicator="torch_distributed")
    return load_sharded_model(model, getattr(torch, dtype), torch.device(device), group.rank_in_group, tp_size,
                              attn_implementation, group_name=group.group_name)
