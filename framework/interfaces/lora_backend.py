"""LoRA backend: the batched LoRA computation of one step, ``y += (x A^T) B^T * scale`` per token's adapter.

Multi-LoRA serving runs one forward over tokens of several adapters (and of the base model). Every LoRA-wrapped
linear (``framework/model_executor/lora_layers.py``) holds its adapters' weights stacked in ``max_loras`` slots
(``lora_a`` ``(max_loras, max_lora_rank, in_features)``, ``lora_b`` ``(max_loras, out_features, max_lora_rank)``,
ranks zero-padded), and each token names its slot (``-1``: no adapter). How the per-token products are computed
is the backend's: Punica's BGMV (gather each token's A and B, one batched matmul; Chen et al., "Punica:
Multi-Tenant LoRA Serving", MLSys 2024), Punica's SGMV (one GEMM per contiguous segment of tokens sharing an
adapter; the same paper, also S-LoRA, Sheng et al., MLSys 2024) or a per-adapter loop (the reference). vLLM's
``PunicaWrapper`` calls the same two halves "shrink" (``x A^T``) and "expand" (``. B^T``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from framework.interfaces.base import Plugin


@dataclass
class LoRABatch:
    """The adapter layout of one step's tokens, built once per step by :meth:`LoRABackend.prepare` and read
    by every LoRA-wrapped linear of the forward."""

    token_slots: torch.Tensor  # (num_tokens,) int64 on the model's device: each token's slot, -1 = no adapter
    any_lora: bool  # False when every token is the base model's (the linears then skip the backend)
    extra: Any = None  # the backend's own per-step data (sgmv: its segments)


class LoRABackend(Plugin, ABC):
    """Computes the LoRA term of a linear for a batch of tokens of mixed adapters. Config ``lora_backend=<name>``
    (used only with ``lora.enable=true``); built once per rank with the config group's ``params``.
    """

    def __init__(self, **params: Any) -> None:
        self.params = params

    def prepare(self, token_slots: torch.Tensor) -> LoRABatch:
        """Build the step's :class:`LoRABatch` from each token's slot.

        Called by the LoRA manager once per step, before the forward; the default keeps ``token_slots``
        only. Mutates nothing.

        Args:
            token_slots: ``(num_tokens,) int64`` on the model's device, in the order of the step's
                flattened tokens (requests are contiguous); ``-1`` for the base model's tokens.
        """
        return LoRABatch(token_slots=token_slots, any_lora=bool((token_slots >= 0).any()))

    @abstractmethod
    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, batch: LoRABatch, part_sizes: tuple[int, ...] | None = None) -> None:
        """Add each token's LoRA term to ``y`` in place: ``y[t] += scales[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T``
        with ``s = batch.token_slots[t]``; tokens with ``s = -1`` are left as they are.

        Called by every LoRA-wrapped linear during the forward (inside the forward context). Mutates ``y`` only.

        Args:
            y: ``(num_tokens, out_features)``, the base linear's output, model dtype.
            x: ``(num_tokens, in_features)``, the linear's input, model dtype.
            lora_a: ``(max_loras, max_lora_rank, in_features)``, model dtype; rows past an adapter's rank are 0.
            lora_b: ``(max_loras, out_features, max_lora_rank)``, model dtype; columns past its rank are 0.
            scales: ``(max_loras,) float32``: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).
            batch: this step's :meth:`prepare` result.
            part_sizes: a fused linear's parts' output widths (q/k/v, gate/up; ``None``: not fused): ``lora_a``'s
                rows are ``P = len(part_sizes)`` blocks of ``max_lora_rank / P`` (one per part) and ``lora_b`` is
                block-diagonal (part ``p``'s output rows read only block ``p``), so the dense formula above holds and a
                backend may ignore it; knowing it, a backend can expand each part with its own block instead of the
                zeros (``bgmv`` does).
        """
