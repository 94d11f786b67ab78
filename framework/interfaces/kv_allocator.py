"""KV allocator: which KV-cache blocks a request owns, prefix reuse and eviction."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

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


@dataclass(frozen=True)
class KVCacheGroup:
    """Decoder layers that share one block table: vLLM's ``KVCacheGroupSpec`` (hybrid KV-cache manager).

    Every group draws its blocks from the same pool; a block holds, for ``block_size`` tokens, the K/V of
    ``layers_per_block`` layers (one KV tensor slot per layer of the group, the slots shared across
    groups: ``framework/core/kv_cache_groups.py``). A request has one block table per group. In a group
    with a ``sliding_window`` the blocks no query can see any more are released and their table entries
    point at the null block (:attr:`KVAllocator.null_block`).
    """

    layer_ids: tuple[int, ...]  # decoder layers whose K/V this group's blocks hold (empty: every layer)
    sliding_window: int | None = None  # W of every layer of the group (sees keys > p - W); None: full attention

    def num_skipped_blocks(self, num_computed_tokens: int, block_size: int) -> int:
        """Leading blocks of a request no query from position ``num_computed_tokens`` on reads any more
        (vLLM's ``SlidingWindowManager.remove_skipped_blocks``): the query at ``num_computed_tokens`` sees
        keys from ``num_computed_tokens - W + 1`` on, so blocks wholly before that are released.

        Returns:
            Blocks, ``0`` for full attention.
        """
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // block_size

    def num_hit_window_blocks(self, block_size: int) -> int | None:
        """Cached blocks a prefix-cache hit of this group needs right before the hit point (vLLM's
        sliding-window cache-hit rule): the first computed query (at the hit point ``h``, a multiple of
        ``block_size``) sees the ``W - 1`` keys before it, ``ceil((W - 1) / block_size)`` blocks.
        ``None`` for full attention (every block before ``h``)."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1) // block_size)


FULL_ATTENTION = KVCacheGroup(layer_ids=())  # the one group of an allocator built without kv_cache_groups


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
        kv_cache_groups: one :class:`KVCacheGroup` per block table a request holds; the engine passes
            them only to a class with ``supports_kv_cache_groups`` (default: one full-attention group).

    Sliding-window KV memory (optional capability ``supports_kv_cache_groups``, vLLM's hybrid KV-cache
    manager): such an allocator keeps one block table per group (:meth:`get_block_tables`), releases a
    sliding group's blocks once they are out of the window of the request's next query
    (:meth:`KVCacheGroup.num_skipped_blocks`; the entries become :attr:`null_block`) and serves prefix
    hits only where every group has what its layers read. An allocator without it gets the default
    single group and the engine keeps every layer's blocks for the whole request (correct, no saving;
    logged at start-up).

    Raises:
        TypeError: unknown keyword parameters.
        ValueError: several groups or a windowed group for a class without ``supports_kv_cache_groups``.
    """

    #: Keeps one block table per :class:`KVCacheGroup` and releases out-of-window blocks of sliding groups.
    supports_kv_cache_groups: ClassVar[bool] = False

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_model_len: int | None = None, kv_cache_groups: Sequence[KVCacheGroup] | None = None,
                 **params: Any) -> None:
        if params:
            raise TypeError(f"kv allocator {self.name!r} got unknown parameters {sorted(params)}")
        groups = tuple(kv_cache_groups or (FULL_ATTENTION,))
        if not self.supports_kv_cache_groups and groups != (FULL_ATTENTION,) and (
                len(groups) > 1 or groups[0].sliding_window is not None):
            raise ValueError(f"kv allocator {self.name!r} keeps one full block table per request "
                             "(supports_kv_cache_groups is False); build it without kv_cache_groups")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_model_len = max_model_len
        self.kv_cache_groups: tuple[KVCacheGroup, ...] = groups

    @property
    def null_block(self) -> int:
        """Block id of released table entries: ``num_blocks``, one past the pool (vLLM's null block). The
        runner allocates it (zeros) when a group has a sliding window; it is never allocated to a request
        and never written, so an attention gather through a released entry stays in bounds and reads
        finite values that the window masks out."""
        return self.num_blocks

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Look up the longest cached prefix of ``request.all_token_ids``.

        Called by the scheduler for a waiting request before admission. Does not take ownership
        (call :meth:`allocate_slots` with the returned blocks for that). Leaves at least one
        token uncomputed so the request can be sampled.

        Returns:
            ``(block_ids, num_computed_tokens)``; ``num_computed_tokens`` is a multiple of
            ``block_size``; ``([], 0)`` on a miss or when prefix caching is off. ``block_ids`` has one
            entry per hit block; with several :attr:`kv_cache_groups` each entry is a tuple of that
            block's id in every group (:attr:`null_block` where a sliding group needs nothing). The
            scheduler passes it back unchanged.
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
        """The request's block table, in token order (a live list: do not mutate); with several
        :attr:`kv_cache_groups`, the first group's."""

    def get_block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of every KV cache group (live lists: do not mutate), in
        :attr:`kv_cache_groups` order; released entries hold :attr:`null_block`.

        A table grows at its end; in a sliding group its leading entries are also replaced by
        :attr:`null_block` as they leave the window (never other ids). A copy that keeps the old ids
        there (a worker mirroring only appended blocks) stays correct: no step reads or writes a
        position before the window of its first query (attention masks by position).

        Called by the scheduler for every scheduled request (``SchedulerOutput.block_ids``). The
        default is ``(get_block_ids(request_id),)`` (one group)."""
        return (self.get_block_ids(request_id),)

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Blocks the request holds now in each KV cache group (null entries excluded; a block shared
        with other requests counts for each): what its KV costs, ``* bytes per block``.

        Called by the scheduler after each allocation (``Request.peak_kv_blocks``). The default
        counts the single table."""
        return (len(self.get_block_ids(request_id)),)

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

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_tokens`` tokens that are not in the prefix cache
        (vLLM's ``cache_blocks``): their K/V arrived after the allocation that covered them (a KV connector's
        asynchronous load, whose blocks the scheduler dropped with :meth:`evict_blocks` until then).

        Called by the scheduler when such a load completes. Default: nothing (the blocks are never hit; correct).
        """

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop these blocks from the prefix cache (vLLM's ``evict_blocks``): their K/V is wrong, e.g. a KV
        connector failed to load them. Owners keep them; a later allocation may hash them again.

        Called by the scheduler after a step whose loads failed (``kv_connector``). Default: nothing to drop
        without prefix caching.

        Raises:
            NotImplementedError: prefix caching is on and this allocator cannot drop single blocks.
        """
        if self.enable_prefix_caching and block_ids:
            raise NotImplementedError(f"kv allocator {self.name!r} cannot evict single blocks from its prefix "
                                      "cache; use kv_cache=paged with a kv_connector")
