"""Quantized paged KV cache for the torch backend: int8 or fp8 e4m3 K/V with per (token, head) scales.

Layout: each cache slot's ``(num_kv_heads, head_size)`` row is stored as ``head_size`` quantized
bytes followed by 4 bytes holding its float32 scale, i.e. one layer's cache is
``(2, num_blocks, block_size, num_kv_heads, head_size + 4)`` ``torch.int8``. Data and scales
therefore live in the same tensor, indexed by block id on dim 1: copying a block (swap, migration)
carries its scales. Symmetric absmax quantization per token and head (as vLLM's per-token-head
``kv_cache_dtype=fp8`` / KIVI-style per-token keys; Liu et al., KIVI, ICML'24, Sec. 3 discusses the
granularity): ``x ~= q * scale``, ``scale = amax / QMAX`` (127 for int8, 448 for e4m3).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale per (token, kv head)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_rows(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Pack ``x (num_tokens, num_kv_heads, head_size)`` float into ``(num_tokens, num_kv_heads, head_size + 4)``
    int8: quantized values then the float32 scale's bytes."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / QMAX[kv_dtype]).clamp(min=1e-8)  # (T, KVH, 1) float32
    if kv_dtype == torch.int8:
        q = (xf / scale).round().clamp(-127, 127).to(torch.int8)
    else:
        q = (xf / scale).to(torch.float8_e4m3fn).view(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(packed: torch.Tensor, kv_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: ``(..., head_size + 4)`` int8 -> ``(..., head_size)`` ``out_dtype``."""
    data, scale_bytes = packed[..., :-SCALE_BYTES], packed[..., -SCALE_BYTES:]
    scale = scale_bytes.contiguous().view(torch.float32)  # (..., 1)
    values = data.float() if kv_dtype == torch.int8 else data.contiguous().view(torch.float8_e4m3fn).float()
    return (values * scale).to(out_dtype)
