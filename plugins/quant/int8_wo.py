"""``quant=int8_wo``: int8 weight-only, symmetric per-output-channel scales.

CPU: torch's own ``aten._weight_int8pack_mm`` (int8 weights streamed into the matmul, scales applied
to the output; the kernel gpt-fast uses for CPU int8), ~4x faster than a bfloat16 ``linear`` for
SmolLM2's shapes at batch 1. CUDA: torchao ``Int8WeightOnlyConfig``. The matmul runs in the
activation dtype, so float32 runs stay float32.
Reference: gpt-fast (PyTorch, 2023) int8 weight-only; torchao ``quantize_`` API.
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from plugins.quant._common import LinearQuantMethod, replace_linears, torchao_quantize


class Int8PackedLinear(torch.nn.Module):
    """CPU int8 weight-only linear on ``aten._weight_int8pack_mm``.

    Buffers: ``weight_int8`` ``(out, in)`` int8 (symmetric, round-to-nearest); ``scales`` ``(out,)``
    in the activation dtype (``max|w_row| / 127``). ``forward``: ``x (..., in)`` float -> ``(..., out)``
    same dtype.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-8)
        self.register_buffer("weight_int8", torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features)`` -> ``(..., out_features)``."""
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8,
                                               self.scales.to(x.dtype))
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int8WeightOnly(LinearQuantMethod):
    """int8 weights (per-channel scales) x float activations; ``lm_head``/embedding untouched."""

    name = "int8_wo"

    def quantize_linears(self, decoder: torch.nn.Module) -> None:
        """CPU: swap in :class:`Int8PackedLinear`; CUDA: torchao ``Int8WeightOnlyConfig``."""
        if next(decoder.parameters()).device.type == "cuda":
            from torchao.quantization import Int8WeightOnlyConfig

            self.backend_note = "torchao Int8WeightOnlyConfig (CUDA), per-channel int8 weights"
            torchao_quantize(decoder, Int8WeightOnlyConfig(), self)
            return
        self.backend_note = "aten._weight_int8pack_mm, per-channel int8 weights"
        replace_linears(decoder, self, Int8PackedLinear)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``int8_wo``."""
    register("int8_wo", Int8WeightOnly)
