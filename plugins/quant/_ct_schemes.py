"""compressed-tensors schemes: which ones ``quant=compressed_tensors`` loads, and one layer's tensors per format
(the format of ``compressed_tensors.compressors``: ``pack_quantized`` and ``naive_quantized``'s int/float aliases).
Tensor layouts: ``plugins/quant/compressed_tensors.py``."""

from __future__ import annotations

from typing import Any

import torch

from framework.model_executor.quantized_checkpoint import CheckpointTensors
from plugins.quant._checkpoint import expect, num_groups
from plugins.quant._checkpoint_linears import IntWeights
from plugins.quant._input_quant import Fp8Weights, InputQuant
from plugins.quant._packing import ct_unpack

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: format -> (weight type, allowed bits, allowed strategies, allowed input type or None)
RULES = {"pack-quantized": ("int", (4, 8), ("channel", "group"), None),
         "int-quantized": ("int", (8,), ("channel", "tensor"), "int"),
         "float-quantized": ("float", (8,), ("channel", "tensor"), "float")}


def scheme_problems(scheme: dict[str, Any], default_format: str | None) -> list[str]:
    """Why one ``config_groups`` entry cannot load (each problem starts with the field it is about)."""
    fmt = scheme.get("format") or default_format
    if fmt not in RULES:
        return [f": format {fmt!r} is not loaded (loaded: {FORMATS})"]
    wtype, bits, strategies, in_type = RULES[fmt]
    w, act = scheme.get("weights") or {}, scheme.get("input_activations")
    problems = []
    if w.get("type", "int") != wtype or w.get("num_bits") not in bits:
        problems.append(f".weights: {w.get('type')!r} {w.get('num_bits')!r}-bit; {fmt} loads {wtype} {bits}-bit")
    if w.get("strategy") not in strategies:
        problems.append(f".weights.strategy={w.get('strategy')!r}; {fmt} loads {strategies}")
    if fmt != "pack-quantized" and not w.get("symmetric", True):
        problems.append(f".weights.symmetric=false; {fmt} loads symmetric weights only")
    if w.get("actorder") == "group":
        problems.append(".weights.actorder='group' (weight_g_idx) is not loaded")
    if scheme.get("output_activations"):
        problems.append(".output_activations: output quantization is not loaded")
    if act:
        dynamic_token = act.get("dynamic") is True and act.get("strategy") == "token"
        static_tensor = act.get("dynamic") is False and act.get("strategy") == "tensor"
        if in_type is None or act.get("type") != in_type or act.get("num_bits") != 8:
            problems.append(f".input_activations: {act.get('type')!r} {act.get('num_bits')!r}-bit inputs are not "
                            f"loaded with {fmt}" + (f" (loaded: 8-bit {in_type})" if in_type else " (weight-only)"))
        if not act.get("symmetric", True) or not (dynamic_token or static_tensor):
            problems.append(".input_activations: only symmetric dynamic per-token or static per-tensor inputs load")
    return problems


def unpack_packed(tensors: CheckpointTensors, name: str, linear: torch.nn.Linear, args: dict[str, Any],
                  ) -> IntWeights:
    """A ``pack-quantized`` layer's ``weight_packed``/``weight_scale``/``weight_zero_point``/``weight_shape``.

    Raises:
        ValueError: a tensor missing or of the wrong dtype/shape (names it).
    """
    bits, out_f, in_f = int(args["num_bits"]), linear.out_features, linear.in_features
    groups = 1 if args["strategy"] == "channel" else num_groups(name, in_f, int(args["group_size"]))
    shape = expect(tensors, f"{name}.weight_shape", (torch.int32, torch.int64), (2,))
    if shape.tolist() != [out_f, in_f]:
        raise ValueError(f"checkpoint tensor {name}.weight_shape is {shape.tolist()}, the layer is {[out_f, in_f]}")
    packed = expect(tensors, f"{name}.weight_packed", torch.int32, (out_f, -(-in_f * bits // 32)))
    scales = expect(tensors, f"{name}.weight_scale", SCALE_DTYPES, (out_f, groups))
    offset = 2 ** (bits - 1)
    if args.get("symmetric", True):
        zeros = torch.full((out_f, groups), offset, dtype=torch.int32)
    else:
        zp = expect(tensors, f"{name}.weight_zero_point", torch.int32, (-(-out_f * bits // 32), groups))
        zeros = ct_unpack(zp, bits, out_f, dim=0) + offset
    return IntWeights(codes=ct_unpack(packed, bits, in_f, dim=1) + offset, zeros=zeros.contiguous(),
                      scales=scales.float(), g_idx=torch.arange(in_f) * groups // in_f, bits=bits, bias=None)


def unpack_unpacked(tensors: CheckpointTensors, name: str, linear: torch.nn.Linear, fmt: str,
                    ) -> IntWeights | Fp8Weights:
    """An ``int-quantized`` (int8) or ``float-quantized`` (e4m3) layer's ``weight`` and ``weight_scale``
    (``(out, 1)``, or one value for the ``tensor`` strategy).

    Raises:
        ValueError: a tensor missing or of the wrong dtype/shape (names it).
    """
    out_f, in_f = linear.out_features, linear.in_features
    dtype = torch.int8 if fmt == "int-quantized" else torch.float8_e4m3fn
    weight = expect(tensors, f"{name}.weight", dtype, (out_f, in_f))
    scales = expect(tensors, f"{name}.weight_scale", SCALE_DTYPES, None).float()
    if scales.numel() == 1:
        scales = scales.reshape(1, 1).expand(out_f, 1)
    elif tuple(scales.shape) != (out_f, 1):
        raise ValueError(f"checkpoint tensor {name}.weight_scale has shape {tuple(scales.shape)}, expected "
                         f"{(out_f, 1)} (channel) or one value (tensor)")
    if fmt == "float-quantized":
        return Fp8Weights(weight=weight, scales=scales.contiguous(), bias=None)
    return IntWeights(codes=weight.to(torch.int32) + 128, zeros=torch.full((out_f, 1), 128, dtype=torch.int32),
                      scales=scales.contiguous(), g_idx=torch.zeros(in_f, dtype=torch.int64), bits=8, bias=None)


def input_quant(tensors: CheckpointTensors, name: str, scheme: dict[str, Any]) -> InputQuant | None:
    """The input quantization of layer ``name``'s scheme (None: weight-only); a static one reads ``input_scale``.

    Raises:
        ValueError: a static scheme without one ``input_scale`` value (names the tensor).
    """
    act = scheme.get("input_activations")
    if not act:
        return None
    kind = "int8" if act.get("type") == "int" else "fp8"
    if act.get("dynamic"):
        return InputQuant(kind, None)
    scale = expect(tensors, f"{name}.input_scale", SCALE_DTYPES, None)
    if scale.numel() != 1:
        raise ValueError(f"checkpoint tensor {name}.input_scale has {scale.numel()} values; a per-tensor scale has 1")
    return InputQuant(kind, scale.float().reshape(()))
