"""``lora_backend=bgmv`` (the default): gather each token's A and B, then one batched matrix-vector product.

Punica's BGMV kernel (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024, section 4) as plain torch:
``A[slot[t]]`` and ``B[slot[t]]`` are gathered per token and multiplied in one ``bmm`` each (shrink, expand),
so the cost does not depend on how many adapters the step mixes; base-model tokens get scale 0.
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.lora_backend import LoRABackend, LoRABatch


class BGMVBackend(LoRABackend):
    """Per-token gather + batched matmul. Memory: ``num_tokens * max_lora_rank * (in + out)`` gathered weights."""

    name = "bgmv"

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, batch: LoRABatch) -> None:
        """``y[t] += scales[s] * B[s] (A[s] x[t])`` for every token at once (``s = -1``: scale 0)."""
        slots = batch.token_slots
        index = slots.clamp(min=0)
        shrunk = torch.bmm(lora_a[index], x.unsqueeze(-1))  # (T, r, 1)
        expanded = torch.bmm(lora_b[index], shrunk).squeeze(-1)  # (T, out)
        scale = torch.where(slots >= 0, scales[index], torch.zeros((), dtype=scales.dtype, device=scales.device))
        y.add_((expanded * scale.unsqueeze(-1).to(expanded.dtype)).to(y.dtype))


@hookimpl
def register_lora_backends(register: Register) -> None:
    """Register ``bgmv``."""
    register("bgmv", BGMVBackend)
