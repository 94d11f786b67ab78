"""Contiguous per-request KV reservation: the pre-PagedAttention baseline (Orca / FasterTransformer).

Each admitted request reserves one contiguous slab of ``ceil(max_model_len / block_size)`` blocks
up front, whatever its actual length, and shares nothing (no prefix caching). The waste this
causes — reserved-but-unused slots and the lower concurrency that follows — is what Kwon et al.
measure in "Efficient Memory Management for Large Language Model Serving with PagedAttention"
(SOSP'23, Sec. 2.3, Fig. 2); ``kv_cache=contiguous`` vs ``kv_cache=paged`` reproduces it. The pool
is cut into ``num_blocks // slab`` slabs; the remaining blocks are never used (external
fragmentation of a fixed-size partition).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import KVAllocator, KVCacheStats


class ContiguousKVAllocator(KVAllocator):
    """One ``max_model_len`` slab per running request; no sharing, no prefix cache.

    A request's block table is the prefix of its slab covering its allocated tokens (the runner
    needs no more); the rest of the slab stays reserved until the request is freed.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: ignored (this baseline never shares blocks).
        max_model_len: tokens each request reserves, rounded up to whole blocks.

    Raises:
        ValueError: ``max_model_len`` missing, or the pool is smaller than one slab.
    """

    name = "contiguous"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, **params: Any) -> None:
        super().__init__(num_blocks, block_size, False, max_model_len, **params)
        if not max_model_len:
            raise ValueError("kv_cache=contiguous reserves max_model_len tokens per request; pass max_model_len")
        self.slab_blocks = -(-max_model_len // block_size)
        num_slabs = num_blocks // self.slab_blocks
        if num_slabs < 1:
            raise ValueError(f"kv_cache=contiguous: {num_blocks} blocks hold no {self.slab_blocks}-block slab "
                             f"(max_model_len={max_model_len}); raise the KV budget or lower max_model_len")
        self._free_slabs: deque[int] = deque(range(num_slabs))
        self._slab: dict[str, int] = {}  # request id -> its slab
        self._tables: dict[str, list[int]] = {}  # request id -> used prefix of its slab
        self._num_tokens: dict[str, int] = {}  # request id -> tokens allocated

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Always a miss: this baseline has no prefix cache."""
        return [], 0

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[int] | None = None) -> bool:
        """True when the request's tokens fit its (existing or a free) slab; changes nothing.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_total = request.num_computed_tokens + num_new_tokens
        has_slab = request.request_id in self._slab
        return num_total <= self.slab_blocks * self.block_size and (has_slab or bool(self._free_slabs))

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Reserve a slab at the request's first allocation; extend its table inside the slab.

        Returns:
            Blocks newly added to the table, or ``None`` when no slab is free (nothing changed).
        """
        if not self.can_allocate(request, num_new_tokens):
            return None
        rid = request.request_id
        if rid not in self._slab:
            self._slab[rid] = self._free_slabs.popleft()
            self._tables[rid] = []
        num_total = request.num_computed_tokens + num_new_tokens
        self._num_tokens[rid] = num_total
        table = self._tables[rid]
        first = self._slab[rid] * self.slab_blocks
        new = list(range(first + len(table), first + -(-num_total // self.block_size)))
        table.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Return the request's slab; unknown or already-freed requests are a no-op."""
        rid = request.request_id
        slab = self._slab.pop(rid, None)
        if slab is not None:
            self._free_slabs.append(slab)
        self._tables.pop(rid, None)
        self._num_tokens.pop(rid, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The used prefix of the request's slab (live list; ``[]`` for unknown ids)."""
        return self._tables.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Nothing is cached here: succeeds whenever no request holds a slab."""
        return not self._tables

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """The whole slab (reserved whatever the request's length), or 0 for unknown ids."""
        return (self.slab_blocks if request_id in self._slab else 0,)

    @property
    def num_free_blocks(self) -> int:
        """Blocks not reserved by any request (free slabs plus the never-usable remainder)."""
        return self.num_blocks - len(self._slab) * self.slab_blocks

    def stats(self) -> KVCacheStats:
        """Usage counts whole slabs as used; fragmentation = reserved-but-unused slots / reserved."""
        return KVCacheStats(num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks,
                            num_reserved_slots=len(self._slab) * self.slab_blocks * self.block_size,
                            num_used_slots=sum(self._num_tokens.values()))

    def check_invariants(self) -> None:
        """Assert slabs are owned at most once and tables stay inside their slab.

        Raises:
            AssertionError: naming the violated invariant.
        """
        owned = list(self._slab.values())
        assert len(set(owned)) == len(owned), f"a slab has two owners: {self._slab}"
        assert not set(owned) & set(self._free_slabs), "a slab is both free and owned"
        assert len(owned) + len(self._free_slabs) == self.num_blocks // self.slab_blocks, "a slab leaked"
        for rid, table in self._tables.items():
            first = self._slab[rid] * self.slab_blocks
            assert table == list(range(first, first + len(table))), f"{rid}: table leaves its slab"
            assert len(table) * self.block_size >= self._num_tokens[rid], f"{rid}: table too short"


@hookimpl
def register_kv_allocators(register: Register) -> None:
    """Register ``contiguous``."""
    register("contiguous", ContiguousKVAllocator)
