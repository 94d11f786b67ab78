"""``quant=w8a8``: int8 dynamic per-token activations x int8 per-channel weights (SmoothQuant-style W8A8
without smoothing; torchao ``Int8DynamicActivationInt8WeightConfig``).

Activations are quantized per token at run time, the matmul is int8 x int8 -> int32 where torchao has
the kernel, then rescaled. Reference: Xiao et al., SmoothQuant (ICML'23), Sec. 3 (W8A8 scheme).
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from plugins.quant._common import LinearQuantMethod, torchao_quantize


class Int8DynamicActInt8Weight(LinearQuantMethod):
    """int8 weights and per-token dynamically quantized int8 activations; ``lm_head``/embedding untouched."""

    name = "w8a8"

    def quantize_linears(self, decoder: torch.nn.Module) -> None:
        """Convert the selected linears with torchao ``Int8DynamicActivationInt8WeightConfig``."""
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        self.backend_note = "torchao Int8DynamicActivationInt8WeightConfig, per-token int8 activations"
        torchao_quantize(decoder, Int8DynamicActivationInt8WeightConfig(), self)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``w8a8``."""
    register("w8a8", Int8DynamicActInt8Weight)
