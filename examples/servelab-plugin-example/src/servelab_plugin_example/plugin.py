"""The plugins: ``lifo`` (newest request first) and ``peak_paged`` (paged allocator recording peak use)."""

from __future__ import annotations

from typing import Any

from framework import hookimpl
from framework.interfaces import SchedulerPolicy
from plugins.kv_allocators.paged import PagedKVAllocator


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


@hookimpl
def register_schedulers(register: Any) -> None:
    """Register ``lifo``."""
    register("lifo", LIFOPolicy)


@hookimpl
def register_kv_allocators(register: Any) -> None:
    """Register ``peak_paged``."""
    register("peak_paged", PeakPagedKVAllocator)
