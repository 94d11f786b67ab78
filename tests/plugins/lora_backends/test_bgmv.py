"""``lora_backend=bgmv``: the LoRA backend contract (framework/testing/lora_backend.py) and the registry key, for its
C++ kernel (``kernel=auto`` on the CPU) and its two torch forms (``kernel=torch``: stacked and gather)."""

from __future__ import annotations

import pytest
import torch

from framework import registry
from framework.testing import check_lora_backend
from plugins.lora_backends.bgmv import BGMVBackend


def test_registered_as_bgmv():
    assert registry.get_class("lora_backend", "bgmv") is BGMVBackend


@pytest.mark.parametrize("params", [{}, {"kernel": "torch"}, {"kernel": "torch", "stacked_max_width": 0}],
                         ids=["kernel", "stacked", "gather"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bgmv_passes_the_lora_backend_contract(seed, params):
    check_lora_backend(BGMVBackend, params, seed=seed)


def test_the_form_follows_the_step_width():
    """``stacked`` up to ``stacked_max_width`` columns (U adapters x rank), ``gather`` past it: equal terms."""
    gen = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(6, 16, generator=gen), torch.randn(4, 8, 16, generator=gen), torch.randn(4, 12, 8, generator=gen)
    scales = torch.tensor([0.5, 1.0, 2.0, 4.0])
    slots = torch.tensor([0, 0, 3, -1, 1, 3])
    terms = {}
    for width in (24, 23):  # 3 adapters x rank 8 = 24 columns: stacked at 24, gather at 23
        backend = BGMVBackend(stacked_max_width=width, kernel="torch")
        y = torch.zeros(6, 12)
        backend.add_lora(y, x, a, b, scales, backend.prepare(slots))
        terms[width] = y
    expected = torch.stack([scales[s] * (b[s] @ (a[s] @ x[t])) if s >= 0 else torch.zeros(12)
                            for t, s in enumerate(slots.tolist())])
    torch.testing.assert_close(terms[24], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(terms[23], expected, rtol=1e-5, atol=1e-5)
    assert terms[3 * 8].ne(0).any() and terms[24][3].eq(0).all()  # the base token's row untouched


def test_a_bad_width_or_kernel_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="lora_backend.params.stacked_max_width must be an int >= 0"):
        BGMVBackend(stacked_max_width=-1)
    with pytest.raises(ValueError, match="lora_backend.params.kernel must be one of"):
        BGMVBackend(kernel="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_fused_parts_match_float64(dtype, caplog):
    """A fused q/k/v linear (three parts, block-diagonal B), mixed slots and base tokens: the kernel's term within
    float32 accumulation (float32) or one bf16 rounding of y (bfloat16) of the float64 product, and it was the kernel
    that ran (the log says so; on a machine without a compiler it names why, and this test skips)."""
    from plugins.lora_backends import bgmv

    lib, why = bgmv._library()
    if lib is None:
        pytest.skip(f"servelab_bgmv does not build here: {why}")
    gen = torch.Generator().manual_seed(2)
    rank, sizes, in_f, slots = 4, (24, 8, 8), 40, torch.tensor([1, -1, 0, 1, 1, 2, -1, 0, 2])
    a = torch.randn(3, 3 * rank, in_f, generator=gen).to(dtype)
    b = torch.zeros(3, sum(sizes), 3 * rank)
    for p, (start, size) in enumerate(zip((0, 24, 32), sizes)):
        b[:, start:start + size, p * rank:(p + 1) * rank] = torch.randn(3, size, rank, generator=gen)
    b, scales = b.to(dtype), torch.tensor([0.5, 2.0, 1.0])
    x, y0 = torch.randn(9, in_f, generator=gen).to(dtype), torch.randn(9, sum(sizes), generator=gen).to(dtype)
    backend, y = BGMVBackend(), y0.clone()
    with caplog.at_level("INFO", logger="plugins.lora_backends.bgmv"):
        backend.add_lora(y, x, a, b, scales, backend.prepare(slots), sizes)
    assert "servelab_bgmv" in caplog.text
    ref = y0.double() + torch.stack([scales[s].double() * (b[s].double() @ (a[s].double() @ x[t].double()))
                                     if s >= 0 else torch.zeros(sum(sizes), dtype=torch.float64)
                                     for t, s in enumerate(slots.tolist())])
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        assert bool(((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3).all())
    assert torch.equal(y[[1, 6]], y0[[1, 6]])  # the base tokens' rows untouched


def test_kernel_torch_is_the_torch_forms_and_says_so(caplog):
    backend = BGMVBackend(kernel="torch")
    with caplog.at_level("INFO", logger="plugins.lora_backends.bgmv"):
        y = torch.zeros(2, 6)
        backend.add_lora(y, torch.randn(2, 4), torch.randn(1, 2, 4), torch.randn(1, 6, 2), torch.ones(1),
                         backend.prepare(torch.tensor([0, -1])))
    assert "the torch forms (lora_backend.params.kernel=torch)" in caplog.text and y[0].ne(0).any()


def _expected(x, a, b, scales, slots):
    return torch.stack([scales[s] * (b[s] @ (a[s] @ x[t])) if s >= 0 else torch.zeros(b.shape[1])
                        for t, s in enumerate(slots.tolist())])


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_stacked_slots_are_reused_until_a_slot_loads_or_the_slot_set_changes(kernel):
    """The stacked A and B (the kernel: the transposed B) of a linear are kept across steps; a slot load (an in-place
    copy into the buffers) or another slot set in the step stacks them again, so no step reads a stale adapter."""
    gen = torch.Generator().manual_seed(1)
    x, a, b = torch.randn(5, 16, generator=gen), torch.randn(3, 4, 16, generator=gen), torch.randn(3, 10, 4, generator=gen)
    scales = torch.tensor([1.0, 0.5, 2.0])
    backend = BGMVBackend(kernel=kernel)
    for slots in (torch.tensor([0, 1, 2, 2, -1]), torch.tensor([0, 1, 2, 2, -1]), torch.tensor([2, 2, 0, -1, -1])):
        y = torch.zeros(5, 10)
        backend.add_lora(y, x, a, b, scales, backend.prepare(slots))
        torch.testing.assert_close(y, _expected(x, a, b, scales, slots), rtol=1e-5, atol=1e-5)
    a[2].copy_(torch.randn(4, 16, generator=gen))  # slot 2 gets another adapter between steps
    b[2].copy_(torch.randn(10, 4, generator=gen))
    slots = torch.tensor([2, 0, 1, 2, -1])
    y = torch.zeros(5, 10)
    backend.add_lora(y, x, a, b, scales, backend.prepare(slots))
    torch.testing.assert_close(y, _expected(x, a, b, scales, slots), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():  # buffers without a version counter are stacked every time, still right
        a_inf, b_inf = a.clone(), b.clone()
        y = torch.zeros(5, 10)
        backend.add_lora(y, x, a_inf, b_inf, scales, backend.prepare(slots))
        a_inf[2].mul_(2.0)
        y2 = torch.zeros(5, 10)
        backend.add_lora(y2, x, a_inf, b_inf, scales, backend.prepare(slots))
        torch.testing.assert_close(y2, _expected(x, a_inf, b_inf, scales, slots), rtol=1e-5, atol=1e-5)
