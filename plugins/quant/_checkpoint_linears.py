"""The linears a pre-quantized checkpoint's layer becomes: the common integer form every format unpacks to
(:class:`IntWeights`), its float reference and the CPU kernels it is repacked into once at load.

Paths (``quant.params.kernel``):

- ``reference``: the weight dequantized to the compute dtype, a plain ``nn.Linear`` (the exactness oracle;
  oneDNN prepacking then applies as to any float linear).
- ``auto`` (default): 4-bit layers run :class:`~plugins.quant._int_gemm.Int4Linear` (the ``quant=int4_wo``
  kernels: servelab's fused int4 GEMM for bf16 on AVX512-BF16 CPUs, else torch's
  ``aten._weight_int4pack_mm_for_cpu``) when torch's shape rules hold: ``out_features % 16 == 0`` and a kernel
  group (256, 128, 64 or 32) dividing both the checkpoint's group and ``in_features``. Zero points fold into the
  kernels' per-group offset (``(q - z) * s == q * s - z * s``); act-order (``g_idx``) becomes a permutation of the input
  columns, applied to the activations each call. 8-bit per-channel layers whose ``q - z`` fit int8 run
  ``aten._weight_int8pack_mm`` (the ``quant=int8_wo`` kernel); 8-bit group-wise ones servelab's fused kernel
  (:class:`~plugins.quant._int_gemm.Int8GroupLinear`, bf16 on AVX512-BF16). Anything else (float8 weights too)
  falls back to ``reference``, and the reason is logged. A W8A8 layer's inputs are quantized in front of either
  path (``plugins/quant/_input_quant.py``).
- ``aten``: as ``auto``, with torch's int4 kernel in place of servelab's fused one (the ablation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.quant._input_quant import Fp8Weights, InputQuant
from plugins.quant._int_gemm import Int4Linear, Int8GroupLinear

INT4_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes aten._weight_int4pack_mm_for_cpu accepts


@dataclass
class IntWeights:
    """One layer's quantized weight in a form common to GPTQ, AWQ and compressed-tensors:
    ``W[o, i] = (codes[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]]``."""

    codes: torch.Tensor  # (out_features, in_features) int32, unsigned in [0, 2**bits)
    zeros: torch.Tensor  # (out_features, num_groups) int32, same domain as codes (the file's offsets applied)
    scales: torch.Tensor  # (out_features, num_groups) float32 (the file's fp16/bf16/fp32 scales, exactly)
    g_idx: torch.Tensor  # (in_features,) int64: group of each input column (act-order permutes them)
    bits: int  # 4 or 8
    bias: torch.Tensor | None  # (out_features,) or None
    input_quant: InputQuant | None = None  # the layer's input quantization (W8A8 schemes), else None

    def dequantize(self) -> torch.Tensor:
        """``(out_features, in_features)`` float32 weight, computed as ``(codes - zeros) * scales`` in float32."""
        return (self.codes - self.zeros[:, self.g_idx]).to(torch.float32) * self.scales[:, self.g_idx]

    def contiguous_groups(self) -> tuple[torch.Tensor | None, int] | None:
        """``(input permutation or None, group_size)`` making every group a contiguous run of ``group_size``
        columns, or None when the groups have unequal sizes."""
        in_features, num_groups = self.codes.shape[1], self.scales.shape[1]
        counts = torch.bincount(self.g_idx, minlength=num_groups)
        if num_groups * int(counts[0]) != in_features or bool((counts != counts[0]).any()):
            return None
        perm = torch.argsort(self.g_idx, stable=True)
        identity = bool((perm == torch.arange(in_features)).all())
        return (None if identity else perm), int(counts[0])

    def per_run(self, in_perm: torch.Tensor | None, run: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(codes, scales, offsets)`` for kernels that take contiguous runs of ``run`` columns: the codes with the
        input columns permuted by ``in_perm`` (act-order; None: as stored) ``(out, in)``, and each run's scale and
        offset ``-zero * scale`` ``(out, in / run)`` float32 (``W = codes * scale + offset``)."""
        codes, g_idx = (self.codes, self.g_idx) if in_perm is None else (self.codes[:, in_perm], self.g_idx[in_perm])
        first = g_idx[torch.arange(0, codes.shape[1], run)]  # the group of each run's first column
        s, z = self.scales[:, first].float(), self.zeros[:, first].float()
        return codes, s, -z * s


class Int4CheckpointLinear(Int4Linear):
    """A 4-bit checkpoint layer on :class:`~plugins.quant._int_gemm.Int4Linear` (servelab's fused int4 GEMM for
    bf16 on AVX512-BF16 CPUs, else ``aten._weight_int4pack_mm_for_cpu``), its scales taken per ``kernel_group``
    columns and act-order as the input permutation ``in_perm``. ``forward``: ``x (..., in)`` -> ``(..., out)``."""

    def __init__(self, w: IntWeights, kernel_group: int, in_perm: torch.Tensor | None, dtype: torch.dtype,
                 kernel: str = "auto") -> None:
        super().__init__(*w.per_run(in_perm, kernel_group), kernel_group, w.bias, in_perm, dtype, kernel)


class Int8CheckpointLinear(torch.nn.Module):
    """An 8-bit per-channel checkpoint layer on ``aten._weight_int8pack_mm``.

    Buffers: ``weight_int8`` ``(out, in)`` int8 (``codes - zeros``), ``scales`` ``(out,)`` in the activation dtype.
    ``forward``: ``x (..., in)`` float -> ``(..., out)`` same dtype.
    """

    def __init__(self, w: IntWeights, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight_int8", (w.codes - w.zeros).to(torch.int8))
        self.register_buffer("scales", w.scales[:, 0].to(dtype))
        self.bias = None if w.bias is None else torch.nn.Parameter(w.bias.to(dtype), requires_grad=False)
        self.out_features, self.in_features = w.codes.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features)`` -> ``(..., out_features)``."""
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8, self.scales)
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def _int8_group_linear(w: IntWeights, dtype: torch.dtype, kernel: str) -> tuple[torch.nn.Module | None, str]:
    """An 8-bit group-wise layer on servelab's fused kernel (torch's int8 kernel takes per-channel scales only), or
    ``(None, why not)``."""
    if kernel == "aten":
        return None, "8-bit group-wise with kernel=aten: torch's int8 kernel takes per-channel scales only"
    layout = w.contiguous_groups()
    if layout is None:
        return None, "8-bit group-wise, g_idx groups of unequal size"
    in_perm, group = layout
    try:
        module = Int8GroupLinear(*w.per_run(in_perm, group), group, w.bias, in_perm, dtype)
    except ValueError as e:
        return None, f"8-bit group-wise: {e}"
    return module, module.kernel + (", act-order input permutation" if in_perm is not None else "")


def reference_linear(w: IntWeights | Fp8Weights, dtype: torch.dtype) -> torch.nn.Linear:
    """A plain ``nn.Linear`` holding the dequantized weight in ``dtype`` (``quant.params.kernel=reference``)."""
    weight = w.dequantize()
    out_f, in_f = weight.shape
    linear = torch.nn.Linear(in_f, out_f, bias=w.bias is not None, dtype=dtype)
    linear.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
    if w.bias is not None:
        linear.bias = torch.nn.Parameter(w.bias.to(dtype), requires_grad=False)
    return linear


def fast_linear(w: IntWeights | Fp8Weights, dtype: torch.dtype, int4_kernel: str = "auto",
                ) -> tuple[torch.nn.Module | None, str]:
    """The CPU kernel module for ``w``, or ``(None, why not)``; the string names the kernel when it is used.
    ``int4_kernel``: ``auto`` (servelab's fused int4 GEMM where it runs) or ``aten`` (torch's int4 kernel only)."""
    if isinstance(w, Fp8Weights):
        return None, "float8 weights: no fp8 matmul on this device"
    out_f, in_f = w.codes.shape
    if w.bits == 8:
        if w.scales.shape[1] != 1:
            return _int8_group_linear(w, dtype, int4_kernel)
        q = w.codes - w.zeros
        if int(q.min()) < -128 or int(q.max()) > 127:
            return None, "8-bit asymmetric: codes minus zero points leave the int8 range"
        return Int8CheckpointLinear(w, dtype), "aten._weight_int8pack_mm (per-channel)"
    layout = w.contiguous_groups()
    if layout is None:
        return None, "g_idx groups of unequal size"
    in_perm, group = layout
    kernel_group = next((g for g in INT4_KERNEL_GROUPS if group % g == 0 and in_f % g == 0), None)
    if kernel_group is None:
        return None, f"group {group} / in_features {in_f} not a multiple of 32 (int4 kernel groups)"
    if out_f % 16:
        return None, f"out_features {out_f} not a multiple of 16 (int4 kernel)"
    perm_note = ", act-order input permutation" if in_perm is not None else ""
    module = Int4CheckpointLinear(w, kernel_group, in_perm, dtype, int4_kernel)
    return module, f"{module.kernel}{perm_note}"
