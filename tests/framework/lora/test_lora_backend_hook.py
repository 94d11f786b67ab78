"""A third-party LoRA backend arrives through ``register_lora_backends`` exactly like the built-ins: it becomes a
``lora_backend`` choice and is held to the same contract; the interface's ``prepare`` and ``add_lora`` directly."""

from __future__ import annotations

import torch

from framework import hookimpl, registry
from framework.interfaces.lora_backend import LoRABackend, LoRABatch
from framework.testing import check_lora_backend
from framework.testing.lora_backend import reference_lora


class DenseLoRA(LoRABackend):
    """Every slot's term for every token, masked: wasteful, but right."""

    name = "dense_test"

    def add_lora(self, y, x, lora_a, lora_b, scales, batch: LoRABatch) -> None:
        terms = torch.einsum("ti,sri,sor->tso", x, lora_a, lora_b) * scales[None, :, None]
        mask = torch.nn.functional.one_hot(batch.token_slots.clamp(min=0), lora_a.shape[0]).to(x.dtype)
        mask *= (batch.token_slots >= 0).to(x.dtype)[:, None]
        y += torch.einsum("tso,ts->to", terms, mask)


class _Plugin:
    @hookimpl
    def register_lora_backends(self, register):
        register("dense_test", DenseLoRA)


def test_a_registered_backend_is_a_choice_and_passes_the_contract():
    with registry.registered(_Plugin()):
        assert registry.get_class("lora_backend", "dense_test") is DenseLoRA
        assert "dense_test" in registry.choices("lora_backend")
        check_lora_backend(DenseLoRA)
    assert "dense_test" not in registry.choices("lora_backend")


def test_prepare_and_add_lora_of_the_default_backend():
    backend = registry.create("lora_backend", "bgmv")
    slots = torch.tensor([1, 1, -1, 0])
    batch = backend.prepare(slots)
    assert batch.any_lora and torch.equal(batch.token_slots, slots)
    assert not backend.prepare(torch.tensor([-1, -1])).any_lora
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 6, generator=gen), torch.randn(4, 5, generator=gen)
    a, b, scales = torch.randn(2, 3, 6, generator=gen), torch.randn(2, 5, 3, generator=gen), torch.tensor([0.5, 2.0])
    expected = reference_lora(y, x, a, b, scales, slots)
    backend.add_lora(y, x, a, b, scales, batch)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
