"""``lora_backend=bgmv``: the LoRA backend contract (framework/testing/lora_backend.py) and the registry key."""

from __future__ import annotations

import pytest
import torch

from framework import registry
from framework.testing import check_lora_backend
from plugins.lora_backends.bgmv import BGMVBackend


def test_registered_as_bgmv():
    assert registry.get_class("lora_backend", "bgmv") is BGMVBackend


@pytest.mark.parametrize("params", [{}, {"stacked_max_width": 0}], ids=["stacked", "gather"])
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
        backend = BGMVBackend(stacked_max_width=width)
        y = torch.zeros(6, 12)
        backend.add_lora(y, x, a, b, scales, backend.prepare(slots))
        terms[width] = y
    expected = torch.stack([scales[s] * (b[s] @ (a[s] @ x[t])) if s >= 0 else torch.zeros(12)
                            for t, s in enumerate(slots.tolist())])
    torch.testing.assert_close(terms[24], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(terms[23], expected, rtol=1e-5, atol=1e-5)
    assert terms[3 * 8].ne(0).any() and terms[24][3].eq(0).all()  # the base token's row untouched


def test_a_bad_width_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="lora_backend.params.stacked_max_width must be an int >= 0"):
        BGMVBackend(stacked_max_width=-1)


def _expected(x, a, b, scales, slots):
    return torch.stack([scales[s] * (b[s] @ (a[s] @ x[t])) if s >= 0 else torch.zeros(b.shape[1])
                        for t, s in enumerate(slots.tolist())])


def test_stacked_slots_are_reused_until_a_slot_loads_or_the_slot_set_changes():
    """The stacked A and B of a linear are kept across steps; a slot load (an in-place copy into the buffers) or
    another slot set in the step stacks them again, so no step reads a stale adapter."""
    gen = torch.Generator().manual_seed(1)
    x, a, b = torch.randn(5, 16, generator=gen), torch.randn(3, 4, 16, generator=gen), torch.randn(3, 10, 4, generator=gen)
    scales = torch.tensor([1.0, 0.5, 2.0])
    backend = BGMVBackend()
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
