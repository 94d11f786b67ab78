"""Pre-quantized checkpoints: which quant method loads one, and the tensors it reads.

A checkpoint is pre-quantized when its ``config.json`` carries a ``quantization_config`` (GPTQ, AWQ,
compressed-tensors: what AutoGPTQ/gptqmodel, AutoAWQ and llm-compressor write). As vLLM does, the
method is detected from the file: the quant method whose ``checkpoint_format`` equals the file's
``quant_method`` loads it. ``quant=none`` takes the detected method; naming another method is refused.
The model loader builds such a model without transformers' quantizer (the packed tensors are read by
the quant method, :class:`CheckpointTensors`), so no quantizer back end needs to be installed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework import registry

if TYPE_CHECKING:
    import torch

    from framework.config import EngineConfig

logger = logging.getLogger(__name__)


def quantization_config(model_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a transformers config as a plain dict (None: not quantized)."""
    qc = getattr(model_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def checkpoint_methods() -> dict[str, str]:
    """Registered quant methods that load pre-quantized checkpoints: file format -> registry name."""
    return {cls.checkpoint_format: name for name, cls in registry.available("quant").items()
            if cls is not None and getattr(cls, "checkpoint_format", None)}


def refuse_prequantized(model_config: Any, quant: str = "none") -> None:
    """Refuse a pre-quantized (GPTQ/AWQ/compressed-tensors...) checkpoint that quant method ``quant`` does not
    load, before its weights load (:func:`resolve_and_log_dtype` already chose the method that does).

    Raises:
        ValueError: the config carries a ``quantization_config`` whose ``quant_method`` is not ``quant``'s
            ``checkpoint_format`` (names both and the fix).
    """
    qc = quantization_config(model_config)
    if qc is None:
        return
    method = str(qc.get("quant_method", "")).lower()
    cls = registry.get_class("quant", quant)
    if cls is None or cls.checkpoint_format != method:
        loaders = checkpoint_methods()
        fix = f"use quant={loaders[method]}" if method in loaders else f"loadable formats: {sorted(loaders)}"
        raise ValueError(f"pre-quantized checkpoint ({method}) with quant={quant}, which does not load it: {fix}; "
                         "or load the unquantized model and use quant=int8_wo|int4_wo|w8a8|fp8")


def resolve_checkpoint_quant(config: EngineConfig, model_config: Any) -> str:
    """The quant method the engine runs for ``config.model``: the one that loads its checkpoint
    format when ``config.json`` has a ``quantization_config``, else ``config.quant``.

    Raises:
        ValueError: the checkpoint's format has no quant method (names the loadable ones), or
            ``config.quant`` names a method other than the checkpoint's (names the fix).
    """
    qc = quantization_config(model_config)
    if qc is None:
        return config.quant
    file_format = str(qc.get("quant_method", "")).lower()
    methods = checkpoint_methods()
    method = methods.get(file_format)
    if method is None:
        raise ValueError(f"{config.model} is a pre-quantized checkpoint (config.json quantization_config.quant_method="
                         f"{file_format!r}) in a format no quant method loads; loadable formats: {sorted(methods)}; "
                         "or load the unquantized model and use quant=int8_wo|int4_wo|w8a8|fp8")
    if config.quant not in ("none", method):
        raise ValueError(f"{config.model} is a {file_format} checkpoint (config.json quantization_config) but "
                         f"quant={config.quant}: drop quant= (it is detected) or use quant={method}")
    if config.quant == "none":
        logger.info("%s is a %s checkpoint (config.json quantization_config): quant=%s", config.model,
                    file_format, method)
    return method


class CheckpointTensors:
    """The tensors of a checkpoint folder's ``*.safetensors`` files, read one at a time on demand.

    Args:
        folder: the model folder (``model.safetensors`` or shards with ``model.safetensors.index.json``).

    Raises:
        FileNotFoundError: the folder holds no ``.safetensors`` file (pre-quantized ``.bin`` files are not read).
    """

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        files = sorted(Path(folder).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no .safetensors file; pre-quantized checkpoints are read from "
                                    "safetensors only")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def keys(self) -> set[str]:
        """Every tensor name in the checkpoint."""
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (dtype and shape of the file).

        Raises:
            KeyError: no such tensor (the message names it).
        """
        if name not in self._where:
            raise KeyError(f"checkpoint tensor {name} is missing")
        return self._where[name].get_tensor(name)


def read_quantization_config(folder: str | Path) -> dict[str, Any]:
    """``quantization_config`` of ``<folder>/config.json``.

    Raises:
        ValueError: the file has none.
    """
    qc = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config")
    if not isinstance(qc, dict):
        raise ValueError(f"{folder}/config.json has no quantization_config: not a pre-quantized checkpoint")
    return qc
