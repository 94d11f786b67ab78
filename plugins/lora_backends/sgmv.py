"""``lora_backend=sgmv``: one shrink and one expand GEMM per contiguous segment of tokens sharing an adapter.

Punica's SGMV (segmented gather matrix-vector; Chen et al., MLSys 2024, section 4; S-LoRA, Sheng et al., MLSys
2024, uses the same segment layout): a step's tokens are contiguous per request, so the runs of equal slots are
the segments; each runs as two dense GEMMs with its adapter's weights (no per-token gather).
"""

from __future__ import annotations

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.lora_backend import LoRABackend, LoRABatch


class SGMVBackend(LoRABackend):
    """Segments computed once per step in :meth:`prepare` (``extra``: ``[(start, end, slot), ...]``, adapter
    tokens only); one pair of GEMMs per segment."""

    name = "sgmv"

    def prepare(self, token_slots: torch.Tensor) -> LoRABatch:
        """Runs of equal slots of ``token_slots`` ``(num_tokens,) int64``, base-model runs dropped."""
        slots = token_slots.tolist()
        segments: list[tuple[int, int, int]] = []
        start = 0
        for t in range(1, len(slots) + 1):
            if t == len(slots) or slots[t] != slots[start]:
                if slots[start] >= 0:
                    segments.append((start, t, slots[start]))
                start = t
        return LoRABatch(token_slots=token_slots, any_lora=bool(segments), extra=segments)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, batch: LoRABatch, part_sizes: tuple[int, ...] | None = None) -> None:
        """``y[start:end] += scales[s] * (x[start:end] A[s]^T) B[s]^T`` per segment (a fused linear's block-diagonal
        B as one dense expand: ``part_sizes`` unused)."""
        for start, end, slot in batch.extra:
            term = (x[start:end] @ lora_a[slot].T) @ lora_b[slot].T
            y[start:end] += (term * scales[slot].to(term.dtype)).to(y.dtype)


@hookimpl
def register_lora_backends(register: Register) -> None:
    """Register ``sgmv``."""
    register("sgmv", SGMVBackend)
