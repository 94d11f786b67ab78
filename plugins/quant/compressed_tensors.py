"""``quant=compressed_tensors``: loads compressed-tensors checkpoints (llm-compressor's output), detected from
``config.json`` (``quant_method: compressed-tensors``).

Loaded: the ``pack-quantized`` format with int weights of 4 or 8 bits, ``channel`` or ``group`` strategy,
symmetric or not, and no activation quantization (W4A16 / W8A16). Per quantized layer
(``compressed_tensors.compressors.pack_quantized.PackedQuantizationCompressor``):

- ``weight_packed`` ``(out, ceil(in * bits / 32))`` int32: signed codes plus ``2 ** (bits - 1)``, packed along
  the input dimension (``plugins/quant/_packing.py``); ``weight_shape`` ``(2,)`` int: ``[out, in]``;
- ``weight_scale`` ``(out, groups)`` float (``groups`` 1 for ``channel``);
- ``weight_zero_point`` (asymmetric only) ``(ceil(out * bits / 32), groups)`` int32, packed along the output dimension.

``W[o, i] = (q[o, i] - z[o, i // group_size]) * s[o, i // group_size]``. Which layers a scheme covers comes
from the file itself (a layer with ``weight_packed`` is quantized); the scheme is the first ``config_groups``
entry whose ``targets`` match the layer (a class name such as ``Linear``, an exact name, or ``re:<regex>``).
Other formats (``int-quantized``, ``float-quantized``, ``naive-quantized``, sparse, nvfp4), activation
quantization and act-order ``weight_g_idx`` are refused before weights load.
Params: ``kernel`` (``auto`` | ``reference``, see ``plugins/quant/_checkpoint.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.model_executor.quantized_checkpoint import CheckpointTensors
from plugins.quant._checkpoint import CheckpointQuantMethod, expect, num_groups
from plugins.quant._checkpoint_linears import IntWeights
from plugins.quant._packing import ct_unpack

FORMATS = ("pack-quantized",)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def matches(target: str, name: str, module: torch.nn.Module) -> bool:
    """compressed-tensors target matching: ``re:<regex>`` against the module name, else the class name or the
    exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (type(module).__name__, name)


class CompressedTensors(CheckpointQuantMethod):
    """compressed-tensors ``pack-quantized`` W4A16 / W8A16 checkpoints (group and channel strategies)."""

    name = "compressed_tensors"
    checkpoint_format = "compressed-tensors"
    marker = "weight_packed"

    @classmethod
    def config_problems(cls, qc: dict[str, Any]) -> list[str]:
        """Every config group is an int 4/8-bit ``channel``/``group`` weight scheme in ``pack-quantized``
        without activation quantization or ``actorder: group``."""
        problems = []
        groups = qc.get("config_groups") or {}
        if not groups:
            problems.append("compressed_tensors: quantization_config.config_groups is empty")
        for key, scheme in groups.items():
            fmt = scheme.get("format") or qc.get("format")
            w = scheme.get("weights") or {}
            where = f"compressed_tensors: quantization_config.config_groups.{key}"
            if fmt not in FORMATS:
                problems.append(f"{where}: format {fmt!r} is not loaded (loaded: {FORMATS})")
            if scheme.get("input_activations") or scheme.get("output_activations"):
                problems.append(f"{where}: activation quantization (W8A8-style) is not loaded; only weight-only "
                                "schemes (W4A16, W8A16)")
            if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
                problems.append(f"{where}.weights: {w.get('type')!r} {w.get('num_bits')!r}-bit; only int 4/8-bit loads")
            if w.get("strategy") not in ("channel", "group"):
                problems.append(f"{where}.weights.strategy={w.get('strategy')!r}; only channel and group load")
            if w.get("actorder") == "group":
                problems.append(f"{where}.weights.actorder='group' (weight_g_idx) is not loaded")
        return problems

    def scheme_of(self, qc: dict[str, Any], name: str, module: torch.nn.Module) -> dict[str, Any]:
        """The ``weights`` args of the first config group targeting layer ``name``.

        Raises:
            ValueError: the file quantized a layer no config group targets.
        """
        for scheme in qc["config_groups"].values():
            if any(matches(t, name, module) for t in scheme.get("targets", [])):
                return scheme["weights"]
        raise ValueError(f"checkpoint tensor {name}.weight_packed: no quantization_config.config_groups entry "
                         "targets this layer")

    def unpack(self, tensors: CheckpointTensors, qc: dict[str, Any], name: str, linear: torch.nn.Linear,
               ) -> IntWeights | None:
        """Layer ``name``'s ``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape`` as
        :class:`IntWeights`.

        Raises:
            ValueError: a tensor missing or of the wrong dtype/shape for the layer and its scheme (names it).
        """
        if f"{name}.weight_packed" not in tensors:
            return None
        if f"{name}.weight_g_idx" in tensors:
            raise ValueError(f"checkpoint tensor {name}.weight_g_idx: act-order compressed-tensors is not loaded")
        args = self.scheme_of(qc, name, linear)
        bits, out_f, in_f = int(args["num_bits"]), linear.out_features, linear.in_features
        groups = 1 if args["strategy"] == "channel" else num_groups(name, in_f, int(args["group_size"]))
        shape = expect(tensors, f"{name}.weight_shape", (torch.int32, torch.int64), (2,))
        if shape.tolist() != [out_f, in_f]:
            raise ValueError(f"checkpoint tensor {name}.weight_shape is {shape.tolist()}, the layer is "
                             f"{[out_f, in_f]}")
        words = -(-in_f * bits // 32)
        packed = expect(tensors, f"{name}.weight_packed", torch.int32, (out_f, words))
        scales = expect(tensors, f"{name}.weight_scale", SCALE_DTYPES, (out_f, groups))
        offset = 2 ** (bits - 1)
        if args.get("symmetric", True):
            zeros = torch.full((out_f, groups), offset, dtype=torch.int32)
        else:
            zp = expect(tensors, f"{name}.weight_zero_point", torch.int32, (-(-out_f * bits // 32), groups))
            zeros = ct_unpack(zp, bits, out_f, dim=0) + offset
        bias = expect(tensors, f"{name}.bias", SCALE_DTYPES, (out_f,)).float() if f"{name}.bias" in tensors else None
        return IntWeights(codes=ct_unpack(packed, bits, in_f, dim=1) + offset, zeros=zeros.contiguous(),
                          scales=scales.float(), g_idx=torch.arange(in_f) * groups // in_f, bits=bits, bias=bias)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``compressed_tensors``."""
    register("compressed_tensors", CompressedTensors)
