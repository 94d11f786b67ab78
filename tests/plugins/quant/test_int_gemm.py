"""servelab's fused int4 GEMM (``plugins/quant/_int_gemm.py``): bf16 outputs within one bf16 rounding (plus
float32 accumulation) of the exact product with the dequantized weight, at every row-block and column-tile tail;
the same as torch's int4 kernel within that; act-order permutation and bias; opaque to ``torch.compile``; and the
fallback to torch's kernel, with its reason, for float32 activations, a CPU without AVX512-BF16 (faked), shapes it
cannot take and a compiler that fails. Kernel tests skip, with the reason, where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch

from plugins.quant import _int_gemm
from plugins.quant._int_gemm import (
    Int4Linear,
    Int8GroupLinear,
    fp16_problem,
    fused_unavailable,
    int_gemm_bf16,
    pack_vnni,
)


@pytest.fixture(scope="module")
def fused() -> None:
    why = fused_unavailable(torch.bfloat16, 64, 64, 32)
    if why is not None:
        pytest.skip(f"the fused int4 kernel does not run here: {why}")


def _layer(n: int, k: int, group: int, seed: int = 0, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 1e-3
    offsets = -torch.randint(0, 2**bits, (n, k // group), generator=g).float() * scales
    return codes, scales, offsets


def _dequantized(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int) -> torch.Tensor:
    """The weight the fused kernel multiplies: scales and offsets as float16 (its ``sb`` layout)."""
    scales, offsets = scales.half().double(), offsets.half().double()
    return codes.double() * scales.repeat_interleave(group, 1) + offsets.repeat_interleave(group, 1)


def _assert_bf16_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``y`` (bf16) within half a bf16 ulp of ``x @ w.T`` (float64) plus float32 accumulation error."""
    ref = x.double() @ w.double().T
    bound = ref.abs() * 2.0**-8 + 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n, k, group", [(48, 128, 32), (64, 96, 32), (80, 256, 128), (1536, 576, 64)])
def test_fused_within_one_bf16_rounding(fused, n: int, k: int, group: int, bits: int) -> None:
    codes, scales, offsets = _layer(n, k, group, bits=bits)
    wq, sb = pack_vnni(codes, scales, offsets, bits)
    w = _dequantized(codes, scales, offsets, group)
    for m in (1, 3, 4, 5, 17, 64):  # row blocks of 4 and every tail; n covers 1-4 column blocks in the last tile
        x = torch.randn(m, k).to(torch.bfloat16)
        y = int_gemm_bf16(x, wq, sb, n, group, bits)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        _assert_bf16_close(y, x, w)


def test_negative_control_a_wrong_code_is_caught(fused) -> None:
    codes, scales, offsets = _layer(48, 128, 32)
    wq, sb = pack_vnni(codes, scales, offsets)
    codes[7, 100] = (codes[7, 100] + 8) % 16
    x = torch.randn(5, 128).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="worst excess"):
        _assert_bf16_close(int_gemm_bf16(x, wq, sb, 48, 32, 4), x, _dequantized(codes, scales, offsets, 32))


def test_module_agrees_with_torch_kernel_with_perm_and_bias(fused) -> None:
    n, k, group = 96, 256, 64
    codes, scales, offsets = _layer(n, k, group, seed=1)
    perm, bias = torch.randperm(k), torch.randn(n)
    ours = Int4Linear(codes, scales, offsets, group, bias, perm, torch.bfloat16)
    aten = Int4Linear(codes, scales, offsets, group, bias, perm, torch.bfloat16, kernel="aten")
    assert ours.fused and ours.kernel.startswith("servelab_int_gemm_bf16")
    assert not aten.fused and "kernel=aten" in aten.kernel
    x = torch.randn(2, 9, k).to(torch.bfloat16)
    y, y_aten = ours(x), aten(x)
    assert y.shape == (2, 9, n)
    w = _dequantized(codes, scales, offsets, group)
    ref = x.reshape(-1, k)[:, perm].double() @ w.double().T + bias.double()
    scale = ref.abs().max()
    assert float((y.reshape(-1, n).double() - ref).abs().max() / scale) < 1e-2
    assert float((y - y_aten).double().abs().max() / scale) < 2e-2


def test_int8_group_layer_with_perm_and_bias(fused) -> None:
    """8-bit group-wise codes (torch has no kernel for them): the module with act-order and bias, and refused with
    the reason where the fused kernel cannot run."""
    n, k, group = 48, 128, 32
    codes, scales, offsets = _layer(n, k, group, seed=3, bits=8)
    perm, bias = torch.randperm(k), torch.randn(n)
    layer = Int8GroupLinear(codes, scales, offsets, group, bias, perm, torch.bfloat16)
    assert layer.kernel.startswith("servelab_int_gemm_bf16 (8-bit")
    x = torch.randn(7, k).to(torch.bfloat16)
    ref = x[:, perm].double() @ _dequantized(codes, scales, offsets, group).T + bias.double()
    assert float((layer(x).double() - ref).abs().max() / ref.abs().max()) < 1e-2
    with pytest.raises(ValueError, match="float32 activations"):
        Int8GroupLinear(codes, scales, offsets, group, None, None, torch.float32)


def test_under_torch_compile(fused) -> None:
    """Dynamo traces the op through its fake (one graph, dynamic rows), as inductor's extern call needs (aot_eager:
    not a compile-speed test; the engine's compiled SmolLM2 GPTQ run was checked equal to eager by hand)."""
    codes, scales, offsets = _layer(32, 64, 32)
    layer = Int4Linear(codes, scales, offsets, 32, torch.randn(32), None, torch.bfloat16)
    x = torch.randn(6, 64).to(torch.bfloat16)
    compiled = torch.compile(lambda t: torch.relu(layer(t)), backend="aot_eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(x), torch.relu(layer(x)))
    assert torch.equal(compiled(x[:3]), torch.relu(layer(x[:3])))


def test_bad_shapes_raise(fused) -> None:
    codes, scales, offsets = _layer(48, 128, 32)
    wq, sb = pack_vnni(codes, scales, offsets)
    with pytest.raises(RuntimeError, match="bad shapes"):
        int_gemm_bf16(torch.randn(2, 128).to(torch.bfloat16), wq, sb, 40, 32, 4)


def test_fallbacks_name_their_reason(monkeypatch) -> None:
    codes, scales, offsets = _layer(48, 128, 32)
    f32 = Int4Linear(codes, scales, offsets, 32, None, None, torch.float32)
    assert not f32.fused and "float32 activations" in f32.kernel
    x = torch.randn(3, 128)
    ref = x.double() @ (codes.double() * scales.double().repeat_interleave(32, 1)  # torch's kernel, float32
                        + offsets.double().repeat_interleave(32, 1)).T
    assert float((f32(x) - ref).abs().max() / ref.abs().max()) < 1e-5
    assert "out % 16" in fused_unavailable(torch.bfloat16, 40, 128, 32)
    monkeypatch.setenv("SERVELAB_CPU_FLAGS", "avx2 fma avx512f")  # an AVX-512 CPU without BW and BF16
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    layer = Int4Linear(codes, scales, offsets, 32, None, None, torch.bfloat16)
    assert not layer.fused and "lacks avx512bw, avx512_bf16" in layer.kernel
    monkeypatch.setenv("SERVELAB_CPU_FLAGS", "avx2 fma avx512f avx512bw avx512_bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # CI's AVX2 emulation caps the kernel away too
    assert "capped by ONEDNN_MAX_CPU_ISA=AVX2" in fused_unavailable(torch.bfloat16, 48, 128, 32)


def test_scales_float16_cannot_hold_take_torch_kernel(fused) -> None:
    codes, scales, offsets = _layer(48, 128, 32)
    assert fp16_problem(scales, offsets) is None
    scales[3, 1] = 1e-6  # a subnormal in float16
    assert "leave float16's normal range" in fp16_problem(scales, offsets)
    layer = Int4Linear(codes, scales, offsets, 32, None, None, torch.bfloat16)
    assert not layer.fused and "float16's normal range" in layer.kernel
    assert "offsets beyond" in fp16_problem(scales * 0 + 0.01, offsets * 0 + 1e6)


def test_failed_build_falls_back(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SERVELAB_CPU_FLAGS", "avx2 fma avx512f avx512bw avx512_bf16")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))  # no built library to reuse
    monkeypatch.setenv("CXX", "false")
    _int_gemm._library.cache_clear()
    try:
        why = fused_unavailable(torch.bfloat16, 48, 128, 32)
        assert why is not None and "building int_gemm_bf16.cpp with false failed" in why
        codes, scales, offsets = _layer(48, 128, 32)
        assert not Int4Linear(codes, scales, offsets, 32, None, None, torch.bfloat16).fused
    finally:
        _int_gemm._library.cache_clear()
    assert not list(tmp_path.rglob("*.so")), "a failed build leaves no library behind"


def test_an_8bit_group_wise_checkpoint_layer_takes_the_fused_kernel(fused) -> None:
    """GPTQ/compressed-tensors 8-bit group-wise weights (act-order too) on the fused kernel, within bf16 rounding of
    the dequantized weight; torch's kernel alone (``kernel=aten``) cannot take them: the reference, with the reason."""
    from plugins.quant._checkpoint_linears import IntWeights, fast_linear

    g = torch.Generator().manual_seed(4)
    n, k, group = 32, 128, 32
    g_idx = torch.randperm(k, generator=g) // group  # act-order: groups scattered over the columns
    w = IntWeights(codes=torch.randint(0, 256, (n, k), generator=g), zeros=torch.randint(0, 256, (n, k // group)),
                   scales=torch.rand(n, k // group, generator=g) * 1e-3 + 1e-4, g_idx=g_idx, bits=8, bias=None)
    module, why = fast_linear(w, torch.bfloat16)
    assert type(module) is Int8GroupLinear and "8-bit" in why and "act-order" in why
    x = torch.randn(6, k).to(torch.bfloat16)
    ref = x.double() @ w.dequantize().double().T
    assert float((module(x).double() - ref).abs().max() / ref.abs().max()) < 1e-2
    assert fast_linear(w, torch.bfloat16, "aten") == (None, "8-bit group-wise with kernel=aten: torch's int8 kernel "
                                                             "takes per-channel scales only")
