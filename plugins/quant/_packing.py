"""Bit packing of the pre-quantized checkpoint formats: int32 words holding ``32 / bits`` integers each.

- GPTQ (AutoGPTQ / gptqmodel ``QuantLinear.pack``): ``qweight`` ``(in * bits / 32, out)`` packs input rows,
  ``qzeros`` ``(groups, out * bits / 32)`` packs output columns; value ``k`` of a word sits at bits
  ``[k * bits, (k + 1) * bits)`` (low bits first).
- AWQ GEMM (AutoAWQ ``WQLinear_GEMM.from_linear``): ``qweight`` ``(in, out / 8)`` and ``qzeros`` ``(groups, out / 8)``
  pack output columns, but word slot ``i`` holds column ``AWQ_ORDER[i]`` of its 8 (``[0, 2, 4, 6, 1, 3, 5, 7]``).
- compressed-tensors ``pack-quantized`` (``compressed_tensors.compressors.pack_quantized.helpers``):
  ``weight_packed`` ``(out, ceil(in * bits / 32))`` packs input columns low bits first after adding
  ``2 ** (bits - 1)`` to the signed value, the last word zero-padded; an asymmetric ``weight_zero_point``
  is packed the same way along the output dimension. For 4 and 8 bits this is :func:`pack_int32` with padding.

Only 4 and 8 bits (the widths that divide 32) are handled; values are unsigned ``[0, 2 ** bits)`` int32.
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: word slot i holds column AWQ_ORDER[i] of its 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c sits in word slot AWQ_REVERSE_ORDER[c]
PACKABLE_BITS = (4, 8)


def _check_bits(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"packing of {bits}-bit values is not supported; bits must be one of {PACKABLE_BITS}")
    return 32 // bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack ``packed`` (int32) along ``dim`` (0 or 1), low bits first.

    Returns:
        int32 tensor whose size along ``dim`` is ``32 / bits`` times larger, values in ``[0, 2 ** bits)``.

    Raises:
        ValueError: ``bits`` not 4 or 8, or ``packed`` not int32.
    """
    per_word = _check_bits(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensors are int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:  # (words, cols) -> (words, per_word, cols)
        values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & (2**bits - 1)
        return values.reshape(packed.shape[0] * per_word, packed.shape[1])
    values = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)  # (rows, words, per_word)
    return values.reshape(packed.shape[0], packed.shape[1] * per_word)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: ``values`` (ints in ``[0, 2 ** bits)``, size along ``dim`` a multiple of
    ``32 / bits``) packed into int32 words along ``dim`` (0 or 1), low bits first.

    Raises:
        ValueError: ``bits`` not 4 or 8, a value out of range, or a size along ``dim`` that ``32 / bits`` does
            not divide.
    """
    per_word = _check_bits(bits)
    v = values.to(torch.int64)
    if v.min() < 0 or v.max() >= 2**bits:
        raise ValueError(f"values to pack must lie in [0, {2**bits}), got [{int(v.min())}, {int(v.max())}]")
    if v.shape[dim] % per_word:
        raise ValueError(f"size {v.shape[dim]} along dim {dim} is not a multiple of {per_word} ({bits}-bit packing)")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    if dim == 0:
        words = (v.view(-1, per_word, v.shape[1]) << shifts.view(1, -1, 1)).sum(1)
    else:
        words = (v.view(v.shape[0], -1, per_word) << shifts).sum(-1)
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)  # two's complement wrap


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM 4-bit ``(rows, cols / 8)`` int32 -> ``(rows, cols)`` int32 in ``[0, 16)`` in column order."""
    slots = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return slots[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`awq_unpack`: ``(rows, cols)`` in ``[0, 16)`` -> ``(rows, cols / 8)`` int32 (AutoAWQ order)."""
    if values.shape[1] % 8:
        raise ValueError(f"AWQ packs 8 columns per word; {values.shape[1]} columns")
    slots = values.reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return pack_int32(slots.reshape(values.shape[0], -1), 4, dim=1)


def ct_unpack(packed: torch.Tensor, bits: int, size: int, dim: int) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` -> signed int32 values ``[-2**(bits-1), 2**(bits-1))``, ``size`` long
    along ``dim`` (the zero-padding of the last word dropped), by the format's own library
    (``compressed_tensors``' ``unpack_from_int32``: faster than :func:`unpack_int32` here, 0.20-0.26 vs 0.23-0.45 ms
    on SmolLM2's layers, and the format's reference)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    shape = list(packed.shape)
    shape[dim] = size
    return unpack_from_int32(packed, bits, torch.Size(shape), packed_dim=dim).to(torch.int32)


def ct_pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`ct_unpack`: signed ``values`` packed along ``dim`` into ``ceil(size * bits / 32)`` words."""
    per_word = 32 // bits
    v = values.to(torch.int64) + 2 ** (bits - 1)
    pad = -v.shape[dim] % per_word
    if pad:
        v = torch.nn.functional.pad(v, (0, pad) if dim == 1 else (0, 0, 0, pad))
    return pack_int32(v, bits, dim)
