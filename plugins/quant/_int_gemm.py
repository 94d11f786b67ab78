"""servelab's fused weight-only GEMM for bf16 activations on AVX512-BF16 CPUs, and the linears on it: 4-bit
(:class:`Int4Linear`: ``quant=int4_wo`` and GPTQ/AWQ/compressed-tensors checkpoints) and 8-bit group-wise
(:class:`Int8GroupLinear`: GPTQ/compressed-tensors checkpoints; torch has no kernel for those).

The kernels compute ``y = x @ W.T`` with ``W[n, k] = codes[n, k] * scale[n, g] + offset[n, g]`` (``g = k //
group_size``, codes in ``[0, 2**bits)``):

- ``servelab_int_gemm_bf16`` (``csrc/int_gemm_bf16.cpp``): chosen for bf16 activations on a CPU with avx512f,
  avx512bw and avx512_bf16 (after ``ONEDNN_MAX_CPU_ISA``/``ATEN_CPU_CAPABILITY`` caps, :func:`~framework.platform.
  cpu_isa`). Above 4 rows each 64-column tile's codes are unpacked once per call and every row reads them with
  ``vdpbf16ps`` (up to 4 rows: unpacked into registers and used at once), scales applied per group: its time
  grows with the rows as a bf16 GEMM's does. On SmolLM2's layers (2-core AMD EPYC, weights not in cache, 4-bit):
  equal to torch's int4 kernel at 1 row, 2x faster at 64 rows, at or under an unpacked bf16 GEMM's time from 16
  rows up (``docs/results/quantization.md``).
  Built once per machine with the C++ compiler into ``$SERVELAB_CACHE/kernels/`` (~1 s) and loaded with ``ctypes``
  (:mod:`framework.model_executor.native`); registered as the op ``servelab::int_gemm_bf16``, opaque to
  ``torch.compile``.
- ``aten._weight_int4pack_mm_for_cpu`` (torch's, float32 FMA per 4 rows: GEMV-shaped): every other 4-bit case, and
  ``kernel="aten"``. Why the fused kernel was not taken is kept on the module (``Int4Linear.kernel``) for the
  loader's log. An 8-bit group-wise layer the fused kernel cannot take is dequantized by the caller (the reference).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "int_gemm_bf16.cpp"
CXX_FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp",
             "-shared", "-fPIC")
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")  # /proc/cpuinfo names the kernel's instructions need
KERNELS = ("auto", "aten")  # auto: the fused kernel where it runs, else torch's; aten: torch's int4 kernel only


@functools.cache
def _library() -> tuple[ctypes.PyDLL | None, str]:
    """The built kernel (:func:`framework.model_executor.native.build_kernel`), or ``(None, why not)``."""
    from framework.model_executor.native import build_kernel

    lib, why = build_kernel(SOURCE, CXX_FLAGS)
    if lib is not None:
        fn = lib.servelab_int_gemm_bf16
        p, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        fn.argtypes = [p, long_, p, p, p, long_, int_, int_, int_, int_, int_, int_]
        fn.restype = int_
    return lib, why


def fused_unavailable(dtype: torch.dtype, out_features: int, in_features: int, group_size: int) -> str | None:
    """None when the fused kernel runs a layer of this shape and activation dtype here, else why not (for the log).

    Builds the kernel on first use (see :func:`_library`)."""
    if dtype != torch.bfloat16:
        return f"{str(dtype).removeprefix('torch.')} activations (it takes bfloat16)"
    if out_features % 16 or in_features % 4 or group_size % 4 or in_features % group_size:
        return (f"shape {out_features} x {in_features}, group {group_size} (it needs out % 16, in % 4 and "
                f"group % 4 = 0, group dividing in)")
    from framework.platform import cpu_isa

    isa = cpu_isa()
    missing = [f for f in REQUIRED_FLAGS if f not in isa.flags]
    if missing:
        capped = f", capped by {isa.capped_by}" if isa.capped_by else ""
        return f"this CPU lacks {', '.join(missing)}{capped}"
    lib, why = _library()
    return None if lib is not None else why


def fp16_problem(scales: torch.Tensor, offsets: torch.Tensor) -> str | None:
    """None when float16 holds ``scales`` (every nonzero one a normal number) and ``offsets`` (finite), else why
    not: the fused kernel reads both as float16 (half the bytes of float32: at one row it is memory-bound)."""
    tiny = torch.finfo(torch.float16).tiny
    nonzero = scales.abs()[scales != 0]
    if nonzero.numel() and (float(nonzero.min()) < tiny or float(nonzero.max()) > 65504):
        return f"scales from {float(nonzero.min()):.3g} to {float(nonzero.max()):.3g} leave float16's normal range"
    if offsets.numel() and float(offsets.abs().max()) > 65504:
        return "zero-point offsets beyond float16's range"
    return None


def pack_vnni(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
              bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's layouts (``csrc/int_gemm_bf16.cpp``'s header).

    Args:
        codes: ``(N, K)`` integer codes in ``[0, 2**bits)``; ``N % 16 == 0``, ``K % 4 == 0``.
        scales, offsets: ``(N, K // group_size)`` float: ``W = codes * scale + offset`` per group; rounded to
            float16 (check :func:`fp16_problem` first).
        bits: 4 (two codes per byte) or 8.

    Returns:
        ``wq`` ``(N // 16, K // 4, 32)`` (4-bit) or ``(N // 16, K // 2, 32)`` (8-bit) uint8, and ``sb``
        ``(N // 16, groups, 2, 16)`` float16.
    """
    n, k = codes.shape
    if bits == 4:
        c = codes.to(torch.uint8).view(n // 16, 16, k // 4, 2, 2)  # (block, column, k quad, k pair, k offset)
        c = c.permute(0, 2, 3, 1, 4).reshape(n // 16, k // 4, 2, 32)  # lane = column * 2 + k offset
        wq = (c[:, :, 0] | (c[:, :, 1] << 4)).contiguous()
    else:
        c = codes.to(torch.uint8).view(n // 16, 16, k // 2, 2)  # (block, column, k pair, k offset)
        wq = c.permute(0, 2, 1, 3).reshape(n // 16, k // 2, 32).contiguous()
    sb = torch.stack([scales.float(), offsets.float()], -1).view(n // 16, 16, -1, 2).permute(0, 2, 3, 1)
    return wq, sb.to(torch.float16).contiguous()


def int_gemm_bf16(x: torch.Tensor, wq: torch.Tensor, sb: torch.Tensor, out_features: int, group_size: int,
                  bits: int) -> torch.Tensor:
    """``x @ W.T`` on the fused kernel (op ``servelab::int_gemm_bf16``; call only where :func:`fused_unavailable`
    said None).

    Args:
        x: ``(M, K)`` bfloat16 (made contiguous if it is not).
        wq, sb: :func:`pack_vnni`'s layouts of ``W`` ``(out_features, K)``.
        out_features: ``N``. group_size: columns per scale group. bits: 4 or 8.

    Returns:
        ``(M, N)`` bfloat16, float32-accumulated, rounded once.

    Raises:
        RuntimeError: the kernel rejected the shapes or ran out of memory.
    """
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    lib, _ = _library()
    rc = lib.servelab_int_gemm_bf16(x.data_ptr(), k, wq.data_ptr(), sb.data_ptr(), y.data_ptr(), out_features, m,
                                    out_features, k, group_size, bits, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"servelab_int_gemm_bf16 returned {rc} for x {tuple(x.shape)}, N {out_features}, "
                           f"group {group_size}, {bits} bits ({'bad shapes' if rc == 1 else 'out of memory'})")
    return y


# torch.library.Library rather than custom_op: its Python wrapper costs ~5 us a call (model_executor/prepack.py)
_LIB = torch.library.Library("servelab", "FRAGMENT")  # noqa: TOR901 - kept alive for the process
_LIB.define("int_gemm_bf16(Tensor x, Tensor wq, Tensor sb, SymInt out_features, int group_size, int bits) -> Tensor")
_LIB.impl("int_gemm_bf16", int_gemm_bf16, "CompositeExplicitAutograd")


@torch.library.register_fake("servelab::int_gemm_bf16")
def _(x: torch.Tensor, wq: torch.Tensor, sb: torch.Tensor, out_features: int, group_size: int,
      bits: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class IntGemmLinear(torch.nn.Module):
    """Base of the weight-only linears on the fused kernel: ``W[n, k] = codes[n, k] * scales[n, g] + offsets[n, g]``.

    Subclasses set the buffers; ``forward`` permutes the input columns (``in_perm``), runs the fused kernel when
    ``fused`` (else the subclass's ``fallback``: :class:`Int4Linear`'s torch kernel) and adds the bias.
    ``x (..., in)`` -> ``(..., out)``.
    """

    fused: bool
    bits: int

    def _fused_buffers(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None, in_perm: torch.Tensor | None, dtype: torch.dtype) -> None:
        if self.fused:
            wq, sb = pack_vnni(codes, scales, offsets, self.bits)
            self.register_buffer("wq", wq)
            self.register_buffer("sb", sb)
        self.register_buffer("in_perm", in_perm)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        self.out_features, self.in_features = codes.shape
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., in_features)`` -> ``(..., out_features)``."""
        x2 = x.reshape(-1, self.in_features)
        if self.in_perm is not None:
            x2 = x2.index_select(1, self.in_perm)
        if self.fused and torch.compiler.is_compiling():  # the op, opaque to the graph
            y = torch.ops.servelab.int_gemm_bf16(x2, self.wq, self.sb, self.out_features, self.group_size, self.bits)
        elif self.fused:  # eager: the function itself, ~3 us a call less than the op's dispatch (210 calls a step)
            y = int_gemm_bf16(x2, self.wq, self.sb, self.out_features, self.group_size, self.bits)
        else:
            y = self.fallback(x2)
        y = y.view(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


class Int4Linear(IntGemmLinear):
    """A 4-bit weight-only linear, on the fused kernel or torch's (module docstring).

    Buffers: fused: ``wq``/``sb`` (:func:`pack_vnni`; scales and offsets as float16, refused by :func:`fp16_problem`
    for torch's kernel when float16 cannot hold them); torch's: ``packed`` (its int4 layout) and
    ``scales_and_zeros`` ``(groups, out, 2)`` in the activation dtype. ``in_perm`` ``(in,)`` int64 or None permutes
    the input columns first (GPTQ act-order). ``kernel``: the kernel's name, and why the fused one was not taken.

    Args:
        codes: ``(out, in)`` integers in ``[0, 16)``. scales, offsets: ``(out, in // group_size)`` float32.
        group_size: a divisor of ``in``; torch's kernel takes 32, 64, 128 or 256.
        bias: ``(out,)`` or None. in_perm: see above. dtype: the activations' dtype.
        kernel: ``auto`` or ``aten`` (:data:`KERNELS`).
    """

    bits = 4

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, in_perm: torch.Tensor | None, dtype: torch.dtype,
                 kernel: str = "auto") -> None:
        super().__init__()
        out_f, in_f = codes.shape
        why = "kernel=aten" if kernel == "aten" else fused_unavailable(dtype, out_f, in_f, group_size)
        if why is None:
            why = fp16_problem(scales, offsets)
        self.fused = why is None
        if self.fused:
            self.kernel = f"servelab_int_gemm_bf16 (4-bit, avx512_bf16, group {group_size})"
        else:  # torch's kernel: W = (q - 8) * scale + zero
            sz = torch.stack([scales.float(), offsets.float() + 8 * scales.float()], -1).transpose(0, 1)
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 1))
            self.register_buffer("scales_and_zeros", sz.contiguous().to(dtype))
            self.kernel = f"aten._weight_int4pack_mm_for_cpu (group {group_size}; not servelab's: {why})"
        self._fused_buffers(codes, scales, offsets, group_size, bias, in_perm, dtype)

    def fallback(self, x2: torch.Tensor) -> torch.Tensor:
        """torch's int4 kernel."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)


class Int8GroupLinear(IntGemmLinear):
    """An 8-bit group-wise weight-only linear on the fused kernel (torch has no kernel for group-wise int8 weights;
    where the fused kernel does not run, the caller dequantizes instead).

    Args:
        codes: ``(out, in)`` integers in ``[0, 256)``. scales, offsets: ``(out, in // group_size)`` float32.
        group_size, bias, in_perm, dtype: as :class:`Int4Linear`.

    Raises:
        ValueError: the fused kernel does not run this layer here (the message says why).
    """

    bits = 8

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, in_perm: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        why = fused_unavailable(dtype, *codes.shape, group_size) or fp16_problem(scales, offsets)
        if why is not None:
            raise ValueError(f"servelab_int_gemm_bf16 does not run this 8-bit layer: {why}")
        self.fused = True
        self.kernel = f"servelab_int_gemm_bf16 (8-bit, avx512_bf16, group {group_size})"
        self._fused_buffers(codes, scales, offsets, group_size, bias, in_perm, dtype)
