"""Shared machinery of the quant methods that load pre-quantized checkpoints (``gptq``, ``awq``,
``compressed_tensors``): which linears the file quantized, checking its tensors, choosing each layer's path.

The model loader builds the model without transformers' quantizer; :meth:`CheckpointQuantMethod.apply` then
reads the folder's ``config.json`` ``quantization_config`` and ``*.safetensors``, and replaces every
``nn.Linear`` whose packed tensors the file holds (the file decides, as vLLM's loaders do: a layer stored as a
plain ``weight`` stays float). Each format implements :meth:`config_problems` (the ``quantization_config``) and
:meth:`unpack` (one layer's tensors to :class:`IntWeights`). Paths: ``plugins/quant/_checkpoint_linears.py``.

Params (``quant.params.*``): ``kernel``: ``auto`` (CPU kernels where the layer's shape allows, else the
reference; 4-bit layers on servelab's fused int4 GEMM where it runs), ``aten`` (as ``auto`` with torch's int4
kernel only) or ``reference`` (every layer dequantized to the compute dtype).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import Counter
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from framework.interfaces import QuantMethod
from framework.model_executor.quantized_checkpoint import CheckpointTensors, read_quantization_config
from plugins.quant._checkpoint_linears import IntWeights, fast_linear, reference_linear
from plugins.quant._checkpoint_tp import checkpoint_layer, row_split_problems, shard_weights
from plugins.quant._common import weight_bytes
from plugins.quant._input_quant import Fp8Weights, InputQuantLinear

if TYPE_CHECKING:
    from framework.config import EngineConfig

logger = logging.getLogger(__name__)
KERNELS = ("auto", "aten", "reference")


def expect(tensors: CheckpointTensors, name: str, dtype: torch.dtype | tuple[torch.dtype, ...],
           shape: tuple[int, ...] | None) -> torch.Tensor:
    """Checkpoint tensor ``name``, checked to have ``dtype`` (one of them) and ``shape`` (None: any).

    Raises:
        ValueError: missing, or another dtype or shape (the message names the tensor and both).
    """
    if name not in tensors:
        raise ValueError(f"checkpoint tensor {name} is missing")
    t = tensors.get(name)
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ValueError(f"checkpoint tensor {name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)} for this "
                         "layer and quantization_config (wrong bits or group_size, or a shape that does not divide)")
    return t


def num_groups(name: str, in_features: int, group_size: int) -> int:
    """Groups of ``in_features`` input columns (``group_size == -1``: one).

    Raises:
        ValueError: ``group_size`` does not divide ``in_features`` (names the layer).
    """
    if group_size == -1:
        return 1
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"{name}: group_size={group_size} does not divide in_features={in_features}")
    return in_features // group_size


def group_size_problems(method: str, group: Any) -> list[str]:
    """``quantization_config.group_size`` must be -1 (one group per row) or a positive integer; the problem
    names ``method`` (the format) otherwise."""
    if isinstance(group, int) and (group > 0 or group == -1):
        return []
    return [f"{method}: quantization_config.group_size={group!r}; expected -1 or a positive integer"]


def _meta_model(config: Any) -> torch.nn.Module:
    """The unsharded model on ``meta`` (its linears' full shapes, for unpacking a sharded rank's layers)."""
    from framework.model_executor.tensor_parallel import meta_model

    return meta_model(config)


class CheckpointQuantMethod(QuantMethod):
    """Base of the pre-quantized checkpoint loaders. Subclasses set ``checkpoint_format`` and ``marker`` (the
    tensor suffix that marks a quantized layer) and implement :meth:`config_problems` and :meth:`unpack`."""

    marker: ClassVar[str] = "qweight"  # <layer>.<marker> in the file: the layer is quantized

    def __init__(self, kernel: str = "auto", **params: Any) -> None:
        super().__init__(**params)
        if kernel not in KERNELS:
            raise ValueError(f"quant.params.kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel

    @classmethod
    @abstractmethod
    def config_problems(cls, qc: dict[str, Any]) -> list[str]:
        """Why this method cannot load a checkpoint with ``quantization_config`` ``qc`` (empty: it can).
        Called from :meth:`validate`, before weights load, and again by :meth:`apply`."""

    @abstractmethod
    def unpack(self, tensors: CheckpointTensors, qc: dict[str, Any], name: str, linear: torch.nn.Linear,
               ) -> IntWeights | Fp8Weights | None:
        """Layer ``name``'s tensors as :class:`IntWeights` (or float8 :class:`Fp8Weights`; None: the file keeps this
        layer float).

        Raises:
            ValueError: a missing tensor, or one of the wrong dtype or shape (the message names it).
        """

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """The model is a checkpoint of this format that this method can load (which formats LoRA runs over:
        ``framework/engine/lora_support.py``)."""
        problems = super().validate(config)
        kernel = config.plugin_params("quant").get("kernel", "auto")
        if kernel not in KERNELS:
            problems.append(f"quant.params.kernel must be one of {KERNELS}, got {kernel!r}")
        from framework.model_executor.model_loader import load_model_config
        from framework.model_executor.quantized_checkpoint import quantization_config

        try:
            qc = quantization_config(load_model_config(config.model))
        except (OSError, ValueError, ModuleNotFoundError):  # a missing model is reported by the model checks
            return problems
        if qc is None:
            return problems + [f"quant={cls.name} loads {cls.checkpoint_format} checkpoints, but {config.model}'s "
                               "config.json has no quantization_config (not pre-quantized); quantize it with "
                               "quant=int8_wo|int4_wo|w8a8|fp8, or write a checkpoint with scripts/quantize_checkpoint.py"]
        if qc.get("quant_method") != cls.checkpoint_format:
            return problems + [f"quant={cls.name} loads {cls.checkpoint_format} checkpoints, but {config.model} is a "
                               f"{qc.get('quant_method')} checkpoint; use quant=none (detected)"]
        return problems + cls.config_problems(qc)

    @classmethod
    def tp_group_sizes(cls, qc: dict[str, Any]) -> list[int]:
        """The group sizes a row-parallel shard must not split (-1: one group per row; empty: none to keep,
        e.g. GPTQ act-order, whose scales stay whole on every rank). Default: ``quantization_config.group_size``."""
        return [int(qc.get("group_size", -1))]

    @classmethod
    def validate_tp(cls, config: EngineConfig, tp_size: int) -> list[str]:
        """Packed weights shard along their groups (``plugins/quant/_checkpoint_tp.py``): every row-parallel
        layer's per-rank ``in_features`` must be a multiple of the file's group size."""
        if tp_size == 1:
            return []
        from framework.model_executor.model_loader import load_model_config
        from framework.model_executor.quantized_checkpoint import quantization_config
        from framework.model_executor.tensor_parallel import linear_shapes, tp_problems

        try:
            mc = load_model_config(config.model)
        except (OSError, ValueError):  # a missing model is reported by the model checks
            return []
        qc = quantization_config(mc)
        if qc is None or cls.config_problems(qc) or tp_problems(mc, tp_size):
            return []  # validate() and the executor report those
        return row_split_problems(cls.name, cls.tp_group_sizes(qc), linear_shapes(mc, 1),
                                  linear_shapes(mc, tp_size), tp_size)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Replace the linears the checkpoint quantized (in place); returns ``model``. Under tensor parallelism
        (``model.tp_weight_sources`` and ``tp_world_size``, set by the sharded loader) each linear gets its rank's slice of the layer
        (:func:`plugins.quant._checkpoint_tp.shard_weights`).

        Raises:
            ValueError: a bad ``quantization_config`` or tensor (names it), a quantized tensor for no linear of
                the model, a linear with neither a float nor a quantized weight in the file, or a row-parallel
                shard that splits a group.
        """
        folder = model.name_or_path
        qc = read_quantization_config(folder)
        problems = self.config_problems(qc)
        if problems:
            raise ValueError(f"{folder}: " + "; ".join(problems))
        tensors = CheckpointTensors(folder)
        device = next(model.parameters()).device
        dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
        sources = getattr(model, "tp_weight_sources", None)
        full = model if sources is None else _meta_model(model.config)
        before, paths, done = weight_bytes(model), Counter(), set()
        for name, module in list(model.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            layer, shard = checkpoint_layer(name, sources, full)
            w = self.unpack(tensors, qc, layer, full.get_submodule(layer) if sources is not None else module)
            if w is None:
                tied = layer == "lm_head" and getattr(model.config, "tie_word_embeddings", False)
                if f"{layer}.weight" not in tensors and not tied:
                    raise ValueError(f"checkpoint tensor {layer}.weight is missing (and {layer} is not quantized)")
                continue
            if shard is not None:
                w = shard_weights(w, shard, layer, int(getattr(model, "tp_world_size", 1)))
            new, path = self._linear(w, dtype, device)
            paths[(name.rpartition(".")[2], path)] += 1
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new.to(device))
            done.add(layer)
        self._refuse_orphans(tensors, done)
        if not done:
            raise ValueError(f"{folder}: no linear of the model has quantized tensors ({self.marker}) in the checkpoint")
        for (layer, path), count in sorted(paths.items()):
            logger.info("quant=%s: %d x %s -> %s", self.name, count, layer, path)
        logger.info("quant=%s: %d linears loaded from the checkpoint; weights %.2f MiB -> %.2f MiB", self.name,
                    len(done), before / 2**20, weight_bytes(model) / 2**20)
        return model

    def _linear(self, w: IntWeights | Fp8Weights, dtype: torch.dtype, device: torch.device,
                ) -> tuple[torch.nn.Module, str]:
        module, path = self._weight_linear(w, dtype, device)
        if w.input_quant is None:
            return module, path
        return InputQuantLinear(module, w.input_quant), f"{path}, {w.input_quant.describe()}"

    def _weight_linear(self, w: IntWeights | Fp8Weights, dtype: torch.dtype, device: torch.device,
                       ) -> tuple[torch.nn.Module, str]:
        if self.kernel == "reference":
            return reference_linear(w, dtype), f"reference: dequantized to {dtype} (kernel=reference)"
        if device.type != "cpu":
            return reference_linear(w, dtype), f"reference: dequantized to {dtype} (no {device.type} kernel wired)"
        module, why = fast_linear(w, dtype, "aten" if self.kernel == "aten" else "auto")
        if module is None:
            return reference_linear(w, dtype), f"reference: dequantized to {dtype} ({why})"
        return module, why

    def _refuse_orphans(self, tensors: CheckpointTensors, done: set[str]) -> None:
        """Every quantized layer in the file became a linear of the model."""
        suffix = f".{self.marker}"
        orphans = sorted(k for k in tensors.keys() if k.endswith(suffix) and k.removesuffix(suffix) not in done)
        if orphans:
            raise ValueError(f"checkpoint tensor {orphans[0]} belongs to no nn.Linear of the model "
                             f"({len(orphans)} such tensors)")
