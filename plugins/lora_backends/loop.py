"""``lora_backend=loop``: the reference: one masked pass per distinct adapter of the step.

What a naive multi-LoRA server does (the baseline of Punica's and S-LoRA's evaluations): for every adapter in
the batch, select its tokens and apply ``x A^T B^T * scale``. Cost grows with the number of distinct adapters.
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.lora_backend import LoRABackend, LoRABatch


class LoopBackend(LoRABackend):
    """Per-adapter loop over the step's distinct slots (boolean-mask rows)."""

    name = "loop"

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, batch: LoRABatch, part_sizes: tuple[int, ...] | None = None) -> None:
        """``y[rows] += scales[s] * (x[rows] A[s]^T) B[s]^T`` for each slot ``s >= 0`` present in the step
        (a fused linear's block-diagonal B as one dense expand: ``part_sizes`` unused)."""
        slots = batch.token_slots
        for slot in torch.unique(slots).tolist():
            if slot < 0:
                continue
            rows = slots == slot
            term = (x[rows] @ lora_a[slot].T) @ lora_b[slot].T
            y[rows] += (term * scales[slot].to(term.dtype)).to(y.dtype)


@hookimpl
def register_lora_backends(register: Register) -> None:
    """Register ``loop``."""
    register("loop", LoopBackend)
