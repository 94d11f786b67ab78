"""The plugins: ``lifo`` (newest request first), ``peak_paged`` (paged allocator recording peak use),
``dense_lora`` (a LoRA backend computing every slot's term for every token, then masking) and ``memory`` (a KV
connector keeping prompt blocks in a process-wide dict)."""

from __future__ import annotations

from typing import Any

import torch

from framework import hookimpl
from framework.interfaces import LoRABackend, LoRABatch, SchedulerPolicy
from plugins.kv_allocators.paged import PagedKVAllocator
from servelab_plugin_example.memory_connector import MemoryConnector


class LIFOPolicy(SchedulerPolicy):
    """Last-in-first-out: admit the newest arrival first; preempt the oldest running request.

    An ablation baseline for FCFS (it maximises head-of-line unfairness).
    """

    name = "lifo"
    interface_version = 1  # the servelab plugin interface this class targets

    def key(self, request: Any) -> tuple:
        """``(-arrival_time_s, -seq_no)``: latest arrival first."""
        return (-request.arrival_time, -request.seq_no)


class PeakPagedKVAllocator(PagedKVAllocator):
    """servelab's paged allocator that also records ``peak_blocks_in_use`` (blocks, max over the run)."""

    name = "peak_paged"
    interface_version = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peak_blocks_in_use = 0

    def allocate_slots(self, request: Any, num_new_tokens: int, new_computed_blocks: list[int] | None = None):
        """As :meth:`PagedKVAllocator.allocate_slots`; updates ``peak_blocks_in_use`` on success."""
        new = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks - self.num_free_blocks)
        return new


class DenseLoRA(LoRABackend):
    """``lora_backend=dense_lora``: ``scale * x A^T B^T`` of every slot for every token, kept where the token's
    slot matches (``-1``: none). Wasteful (work grows with ``max_loras``), but the simplest correct backend."""

    name = "dense_lora"
    interface_version = 1

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, batch: LoRABatch) -> None:
        """``y[t] += scales[s] * (x[t] A[s]^T) B[s]^T`` with ``s = batch.token_slots[t]``."""
        terms = torch.einsum("ti,sri,sor->tso", x, lora_a, lora_b) * scales[None, :, None].to(x.dtype)
        slots = batch.token_slots
        mask = torch.nn.functional.one_hot(slots.clamp(min=0), lora_a.shape[0]).to(x.dtype)
        mask = mask * (slots >= 0).to(x.dtype)[:, None]
        y += torch.einsum("tso,ts->to", terms, mask).to(y.dtype)


@hookimpl
def register_schedulers(register: Any) -> None:
    """Register ``lifo``."""
    register("lifo", LIFOPolicy)


@hookimpl
def register_kv_allocators(register: Any) -> None:
    """Register ``peak_paged``."""
    register("peak_paged", PeakPagedKVAllocator)


@hookimpl
def register_lora_backends(register: Any) -> None:
    """Register ``dense_lora``."""
    register("dense_lora", DenseLoRA)


@hookimpl
def register_kv_connectors(register: Any) -> None:
    """Register ``memory``."""
    register("memory", MemoryConnector)
