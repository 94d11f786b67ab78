"""Activation (input) quantization of W8A8 checkpoints, and their float8 weights.

compressed-tensors ``int-quantized`` (W8A8) and ``float-quantized`` (FP8) schemes quantize each linear's input
too: ``dynamic: true`` per token at run time, or with a stored per-tensor ``input_scale`` (static). The scale of
a dynamic token is ``max|x| / 127`` (int8) or ``max|x| / 448`` (e4m3), as vLLM's ``scaled_int8_quant`` /
``scaled_fp8_quant`` compute it. Here the input is quantized and dequantized in float32 before the layer's own
matmul (the reference path and the int8 weight kernel alike): the same numbers an int8 x int8 -> int32 GEMM
sees, summed in float instead of int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@dataclass
class InputQuant:
    """How a layer's input is quantized."""

    kind: str  # "int8" (round to nearest, clamp [-128, 127]) or "fp8" (cast to float8_e4m3fn)
    scale: torch.Tensor | None  # () float32 static per-tensor scale; None: dynamic, one scale per token

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in)`` quantized and dequantized with this scheme, in ``x.dtype`` (computed in float32)."""
        xf = x.float()
        top = INT8_MAX if self.kind == "int8" else FP8_E4M3_MAX
        scale = self.scale if self.scale is not None else xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
        if self.kind == "int8":
            q = torch.round(xf / scale).clamp(-128, 127)
        else:
            q = (xf / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
        return (q * scale).to(x.dtype)

    def describe(self) -> str:
        """For the run log, e.g. ``dynamic per-token int8 inputs``."""
        return f"{'dynamic per-token' if self.scale is None else 'static per-tensor'} {self.kind} inputs"


class InputQuantLinear(torch.nn.Module):
    """``inner`` (a linear of the checkpoint's weights) fed inputs quantized by ``input_quant``.
    ``forward``: ``x (..., in)`` float -> ``(..., out)`` same dtype."""

    def __init__(self, inner: torch.nn.Module, input_quant: InputQuant) -> None:
        super().__init__()
        self.inner, self.input_quant = inner, input_quant
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``inner(fake_quantize(x))``."""
        return self.inner(self.input_quant.fake_quantize(x))


@dataclass
class Fp8Weights:
    """A float8 e4m3 weight with per-channel or per-tensor scales: ``W = weight * scales``."""

    weight: torch.Tensor  # (out_features, in_features) float8_e4m3fn
    scales: torch.Tensor  # (out_features, 1) float32
    bias: torch.Tensor | None  # (out_features,) or None
    input_quant: InputQuant | None = None  # the layer's input quantization, if its scheme has one
    bits: int = 8

    def dequantize(self) -> torch.Tensor:
        """``(out_features, in_features)`` float32 weight."""
        return self.weight.float() * self.scales
