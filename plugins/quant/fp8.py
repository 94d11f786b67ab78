"""``quant=fp8``: float8 e4m3 weights with per-output-channel scales.

Where the GPU has fp8 tensor cores (CUDA compute capability >= 8.9, bfloat16 model) the linears run
a real fp8 x fp8 matmul (torchao ``Float8DynamicActivationFloat8WeightConfig`` with ``PerRow``
granularity: ``torch._scaled_mm``, activations quantized per token at run time). Elsewhere (CPU,
older GPUs) weights are stored e4m3 + per-row scale and upcast to the activation dtype before a
float matmul (torchao ``Float8WeightOnlyConfig``): emulated fp8, memory saving only. The run log
says which. Reference: Micikevicius et al., "FP8 Formats for Deep Learning" (2022), e4m3 format.
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from plugins.quant._common import LinearQuantMethod, torchao_quantize


def has_fp8_matmul(device: torch.device | str) -> bool:
    """True when ``device`` is a CUDA GPU with fp8 tensor cores (compute capability >= 8.9)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


class Float8E4M3(LinearQuantMethod):
    """e4m3 weights, per-channel scales; real fp8 matmul on fp8 GPUs, emulated (upcast) elsewhere."""

    name = "fp8"

    def quantize_linears(self, decoder: torch.nn.Module) -> None:
        """Convert the selected linears; picks the real or the emulated path from the weights' device/dtype."""
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerRow

        param = next(decoder.parameters())
        if has_fp8_matmul(param.device) and param.dtype == torch.bfloat16:
            self.backend_note = "fp8 e4m3 REAL fp8 matmul (torch._scaled_mm, per-row weight, per-token act scales)"
            torchao_quantize(decoder, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), self)
        else:
            self.backend_note = (f"fp8 e4m3 weights, per-row scales, EMULATED: upcast to {param.dtype} before the "
                                 f"matmul ({param.device.type} has no fp8 matmul or dtype is not bfloat16)")
            torchao_quantize(decoder, Float8WeightOnlyConfig(), self)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``fp8``."""
    register("fp8", Float8E4M3)
