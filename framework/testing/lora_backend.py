"""LoRA backend contract (``framework.interfaces.LoRABackend``), model-free: on random batches of mixed adapters
(ranks zero-padded to the slot width, base-model tokens as slot ``-1``, adapters contiguous per request or
interleaved), ``prepare`` + ``add_lora`` add exactly ``scale * x A^T B^T`` per token (float32, within 1e-5 of the
plain-torch reference), leave base-model tokens and every input unchanged, and handle a step with no adapter."""

from __future__ import annotations

import torch

from framework.interfaces.lora_backend import LoRABackend, LoRABatch

TOLERANCE = 1e-5


def reference_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scales: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """The contract, one token at a time: ``y[t] + scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T`` (``s = -1``:
    ``y[t]``). Shapes as :meth:`LoRABackend.add_lora`'s; returns a new tensor."""
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += scales[slot] * ((x[t] @ lora_a[slot].T) @ lora_b[slot].T)
    return out


def random_lora_case(gen: torch.Generator, slots_per_request: list[int], max_loras: int = 4, max_rank: int = 8,
                     in_features: int = 24, out_features: int = 40) -> tuple[torch.Tensor, ...]:
    """``(y, x, lora_a, lora_b, scales, token_slots)`` float32: requests of 1-5 tokens each with the slot given in
    ``slots_per_request`` (``-1``: base), slots of random ranks 1..``max_rank`` zero-padded to ``max_rank``."""
    lengths = torch.randint(1, 6, (len(slots_per_request),), generator=gen)
    token_slots = torch.repeat_interleave(torch.tensor(slots_per_request, dtype=torch.int64), lengths)
    num_tokens = int(lengths.sum())
    lora_a = torch.zeros(max_loras, max_rank, in_features)
    lora_b = torch.zeros(max_loras, out_features, max_rank)
    for slot in range(max_loras):
        rank = int(torch.randint(1, max_rank + 1, (1,), generator=gen))
        lora_a[slot, :rank] = torch.randn(rank, in_features, generator=gen)
        lora_b[slot, :, :rank] = torch.randn(out_features, rank, generator=gen)
    scales = torch.rand(max_loras, generator=gen) * 2
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = torch.randn(num_tokens, out_features, generator=gen)
    return y, x, lora_a, lora_b, scales, token_slots


def _check_case(backend: LoRABackend, case: tuple[torch.Tensor, ...], label: str) -> None:
    y, x, lora_a, lora_b, scales, token_slots = case
    name = type(backend).name
    inputs = [t.clone() for t in (x, lora_a, lora_b, scales, token_slots)]
    expected = reference_lora(y, x, lora_a, lora_b, scales, token_slots)
    batch = backend.prepare(token_slots)
    assert isinstance(batch, LoRABatch), f"{name}.prepare must return a LoRABatch, got {type(batch).__name__}"
    assert batch.any_lora == bool((token_slots >= 0).any()), f"{name}.prepare: any_lora wrong ({label})"
    out = y.clone()
    backend.add_lora(out, x, lora_a, lora_b, scales, batch)
    err = (out - expected).abs().max().item()
    assert err <= TOLERANCE * max(1.0, expected.abs().max().item()), (
        f"{name}.add_lora differs from scale * x A^T B^T by {err:.3g} ({label})")
    base = token_slots < 0
    assert torch.equal(out[base], y[base]), f"{name}.add_lora changed base-model tokens ({label})"
    for before, after in zip(inputs, (x, lora_a, lora_b, scales, token_slots)):
        assert torch.equal(before, after), f"{name}.add_lora or prepare modified an input other than y ({label})"


def check_lora_backend(backend_cls: type[LoRABackend], params: dict | None = None, seed: int = 0) -> None:
    """Run the contract on ``backend_cls(**params)``.

    Raises:
        AssertionError: naming the broken rule and the case.
    """
    backend = backend_cls(**(params or {}))
    gen = torch.Generator().manual_seed(seed)
    cases = {
        "contiguous requests of several adapters and the base": [0, 0, 1, -1, 2, 3],
        "interleaved adapters": [1, -1, 1, 0, 1, 0],
        "one adapter": [2],
        "no adapter in the step": [-1, -1],
        "every slot, one token each": [3, 2, 1, 0],
    }
    for label, slots in cases.items():
        _check_case(backend, random_lora_case(gen, slots), label)
