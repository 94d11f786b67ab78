"""``quant=int8_wo``: int8 weight-only, symmetric per-output-channel scales (torchao ``Int8WeightOnlyConfig``).

Weights are stored int8 with one scale per output row; the matmul runs in the activation dtype
(torchao dequantizes inside its int8 weight-only linear), so float32 runs stay float32.
Reference: gpt-fast (PyTorch, 2023) int8 weight-only; torchao ``quantize_`` API.
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from plugins.quant._common import LinearQuantMethod, torchao_quantize


class Int8WeightOnly(LinearQuantMethod):
    """int8 weights (per-channel scales) x float activations; ``lm_head``/embedding untouched."""

    name = "int8_wo"

    def quantize_linears(self, decoder: torch.nn.Module) -> None:
        """Convert the selected linears' weights to torchao ``Int8Tensor`` (per-row scales)."""
        from torchao.quantization import Int8WeightOnlyConfig

        self.backend_note = "torchao Int8WeightOnlyConfig, per-channel int8 weights, float matmul"
        torchao_quantize(decoder, Int8WeightOnlyConfig(), self)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``int8_wo``."""
    register("int8_wo", Int8WeightOnly)
