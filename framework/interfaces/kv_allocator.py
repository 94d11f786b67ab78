"""KV allocator: which KV-cache blocks a request owns, prefix reuse and eviction."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    from framework.core.request import Request


@dataclass
class KVCacheStats:
    """Cumulative statistics of an allocator."""

    num_blocks: int  # blocks in the pool
    num_free_blocks: int  # blocks with no owner (cached-but-free blocks count as free)
    prefix_queries_tokens: int = 0  # tokens of requests admitted with prefix caching on (once per admission)
    prefix_hits_tokens: int = 0  # of which were served from the prefix cache
    num_reserved_slots: int = 0  # sum over requests of token slots their allocations reserve
    num_used_slots: int = 0  # sum over requests of tokens allocated (computed + scheduled)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def fragmentation(self) -> float:
        """Allocated but unused token slots / allocated slots, in [0, 1] (PagedAttention Sec. 2.3's
        internal fragmentation + reservation waste; shared blocks count once per owner)."""
        if not self.num_reserved_slots:
            return 0.0
        return 1.0 - self.num_used_slots / self.num_reserved_slots

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate over all queries so far, in [0, 1]."""
        return self.prefix_hits_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0


class KVAllocator(Plugin, ABC):
    """Owns the mapping request -> block ids of a paged KV cache (vLLM's ``KVCacheManager``).

    Blocks are integer ids in ``[0, num_blocks)``; block ``b`` holds token slots
    ``[b * block_size, (b + 1) * block_size)`` of the attention backend's cache. The allocator
    never touches tensors; it only hands out ids.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks whose token content (and prefix) match.
        max_model_len: prompt + output cap of a request, tokens (the engine passes it; allocators
            that reserve per request up front, like ``contiguous``, need it).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, **params: Any) -> None:
        if params:
            raise TypeError(f"kv allocator {self.name!r} got unknown parameters {sorted(params)}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Look up the longest cached prefix of ``request.all_token_ids``.

        Called by the scheduler for a waiting request before admission. Does not take ownership
        (call :meth:`allocate_slots` with the returned blocks for that). Leaves at least one
        token uncomputed so the request can be sampled.

        Returns:
            ``(block_ids, num_computed_tokens)``; ``num_computed_tokens`` is a multiple of
            ``block_size``; ``([], 0)`` on a miss or when prefix caching is off.
        """

    @abstractmethod
    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[int] | None = None) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed now.

        Called by the scheduler to decide on preemption before committing; must not change state.
        """

    @abstractmethod
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make the request's blocks cover ``num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` tokens.

        Called by the scheduler every step a request gets tokens. On success the request owns
        ``new_computed_blocks`` (ref counts taken) plus any freshly allocated blocks, and blocks
        that become full this step are published to the prefix cache.

        Returns:
            The newly allocated block ids (possibly empty), or ``None`` when the pool cannot
            satisfy the request; then nothing changed and the scheduler must preempt or wait.
        """

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release all blocks of ``request`` (finish, abort or preemption).

        Cached blocks stay reusable until evicted. Freeing a request that owns nothing is a no-op.
        """

    @abstractmethod
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table, in token order (a live list: do not mutate)."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, including evictable cached blocks)."""

    @abstractmethod
    def stats(self) -> KVCacheStats:
        """Current usage and cumulative prefix-cache statistics."""

    def reset_prefix_cache(self) -> bool:
        """Drop all cached hashes (only when no block is owned). Returns True on success."""
        return False
