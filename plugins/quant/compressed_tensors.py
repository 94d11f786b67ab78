"""``quant=compressed_tensors``: loads compressed-tensors checkpoints (llm-compressor's output), detected from
``config.json`` (``quant_method: compressed-tensors``).

Loaded formats (``compressed_tensors.compressors``):

- ``pack-quantized``: int weights of 4 or 8 bits, ``channel`` or ``group`` strategy, symmetric or not, no
  activation quantization (W4A16 / W8A16). ``weight_packed`` ``(out, ceil(in * bits / 32))`` int32 holds signed
  codes plus ``2 ** (bits - 1)`` packed along the input dimension (``plugins/quant/_packing.py``);
  ``weight_shape`` ``(2,)`` ``[out, in]``; ``weight_scale`` ``(out, groups)`` (``groups`` 1 for ``channel``);
  ``weight_zero_point`` (asymmetric only) ``(ceil(out * bits / 32), groups)`` int32, packed along the output.
  ``W[o, i] = (q[o, i] - z[o, i // group_size]) * s[o, i // group_size]``.
- ``int-quantized`` (W8A8): ``weight`` ``(out, in)`` int8, symmetric, ``weight_scale`` ``(out, 1)`` (``channel``) or
  one value (``tensor``); inputs int8, dynamic per token or static per tensor (``input_scale``).
- ``float-quantized`` (FP8): ``weight`` ``(out, in)`` float8_e4m3fn, ``weight_scale`` as above; inputs e4m3,
  dynamic per token or static (``input_scale``), or none (FP8 weight-only).

Input quantization: ``plugins/quant/_input_quant.py``. Which layers a scheme covers comes from the file itself (a
layer with ``weight_scale`` is quantized); its scheme is the first ``config_groups`` entry whose ``targets``
match the layer (a class name such as ``Linear``, an exact name, or ``re:<regex>``). Other formats
(``naive-quantized``, sparse, nvfp4, block strategies), asymmetric activations, output activations, a
``kv_cache_scheme`` and act-order ``weight_g_idx`` are refused before weights load.
Params: ``kernel`` (``auto`` | ``reference``, see ``plugins/quant/_checkpoint.py``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.model_executor.quantized_checkpoint import CheckpointTensors
from plugins.quant._checkpoint import CheckpointQuantMethod, expect
from plugins.quant._checkpoint_linears import IntWeights
from plugins.quant._ct_schemes import SCALE_DTYPES, input_quant, scheme_problems, unpack_packed, unpack_unpacked
from plugins.quant._input_quant import Fp8Weights


def matches(target: str, name: str, module: torch.nn.Module) -> bool:
    """compressed-tensors target matching: ``re:<regex>`` against the module name, else the class name or the
    exact module name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target in (type(module).__name__, name)


class CompressedTensors(CheckpointQuantMethod):
    """compressed-tensors ``pack-quantized`` (W4A16 / W8A16), ``int-quantized`` (W8A8) and ``float-quantized``
    (FP8) checkpoints."""

    name = "compressed_tensors"
    checkpoint_format = "compressed-tensors"
    marker = "weight_scale"

    @classmethod
    def config_problems(cls, qc: dict[str, Any]) -> list[str]:
        """Every config group is a scheme this method loads (see the module docstring)."""
        problems = []
        groups = qc.get("config_groups") or {}
        if not groups:
            problems.append("compressed_tensors: quantization_config.config_groups is empty")
        if qc.get("kv_cache_scheme"):
            problems.append("compressed_tensors: quantization_config.kv_cache_scheme is not loaded; drop it and use "
                            "engine.kv_cache_dtype=int8|fp8_e4m3")
        for key, scheme in groups.items():
            problems += [f"compressed_tensors: quantization_config.config_groups.{key}{p}"
                         for p in scheme_problems(scheme, qc.get("format"))]
        return problems

    @classmethod
    def tp_group_sizes(cls, qc: dict[str, Any]) -> list[int]:
        """``weights.group_size`` of every ``group``-strategy config group."""
        return [int(g["weights"]["group_size"]) for g in (qc.get("config_groups") or {}).values()
                if (g.get("weights") or {}).get("strategy") == "group"]

    def scheme_of(self, qc: dict[str, Any], name: str, module: torch.nn.Module) -> dict[str, Any]:
        """The first config group (with its resolved ``format``) targeting layer ``name``.

        Raises:
            ValueError: the file quantized a layer no config group targets.
        """
        for scheme in qc["config_groups"].values():
            if any(matches(t, name, module) for t in scheme.get("targets", [])):
                return {**scheme, "format": scheme.get("format") or qc.get("format")}
        raise ValueError(f"checkpoint tensor {name}.weight_scale: no quantization_config.config_groups entry "
                         "targets this layer")

    def unpack(self, tensors: CheckpointTensors, qc: dict[str, Any], name: str, linear: torch.nn.Linear,
               ) -> IntWeights | Fp8Weights | None:
        """Layer ``name``'s tensors as :class:`IntWeights` (int formats) or :class:`Fp8Weights`, with the input
        quantization of its scheme.

        Raises:
            ValueError: a tensor missing or of the wrong dtype/shape for the layer and its scheme (names it).
        """
        if f"{name}.weight_scale" not in tensors and f"{name}.weight_packed" not in tensors:
            return None
        if f"{name}.weight_g_idx" in tensors:
            raise ValueError(f"checkpoint tensor {name}.weight_g_idx: act-order compressed-tensors is not loaded")
        scheme = self.scheme_of(qc, name, linear)
        bias = (expect(tensors, f"{name}.bias", SCALE_DTYPES, (linear.out_features,)).float()
                if f"{name}.bias" in tensors else None)
        if scheme["format"] == "pack-quantized":
            w = unpack_packed(tensors, name, linear, scheme["weights"])
        else:
            w = unpack_unpacked(tensors, name, linear, scheme["format"])
        w.bias, w.input_quant = bias, input_quant(tensors, name, scheme)
        return w


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``compressed_tensors``."""
    register("compressed_tensors", CompressedTensors)
