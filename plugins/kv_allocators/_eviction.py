"""Eviction order of free (ref count 0) KV blocks that may still hold cached prefixes.

A free block stays a prefix-cache hit until it is popped for a new allocation, so the order in
which free blocks are reused *is* the cache's eviction policy:

* ``lru`` — least recently freed first (vLLM's free queue; a request's blocks are freed tail first,
  so a sequence's tail is evicted before its prefix);
* ``fifo`` — oldest content first: the block whose current content was computed earliest;
* ``lfu`` — fewest prefix hits since its content was computed first, ties least recently freed
  (the classic LFU cache policy with LRU tie-breaking).

Owned blocks are never in the queue, so no policy can evict a block some request holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

EVICTION_POLICIES = ("lru", "lfu", "fifo")


class FreeBlockQueue:
    """The free blocks of a pool in eviction order; O(1) for ``lru``, O(log n) for ``lfu``/``fifo``.

    Args:
        policy: one of :data:`EVICTION_POLICIES`.
        blocks: the initially free block ids, in initial eviction order.

    Raises:
        ValueError: an unknown policy (the valid ones are listed).
    """

    def __init__(self, policy: str, blocks: range) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; use kv_cache.params.eviction="
                             f"{'|'.join(EVICTION_POLICIES)}")
        self.policy = policy
        self._clock = itertools.count()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._heap: list[tuple[tuple[int, ...], int]] = []  # (key, block); stale entries skipped on pop
        self._key: dict[int, tuple[int, ...]] = {}  # free block -> its live heap key
        self._hits: dict[int, int] = {}  # block -> prefix hits of its current content (lfu)
        self._born: dict[int, int] = {}  # block -> when its current content was allocated (fifo)
        for block in blocks:
            self.push(block)

    def __eq__(self, other: object) -> bool:
        """Same policy, same free blocks in the same eviction order, same hit/age bookkeeping."""
        if not isinstance(other, FreeBlockQueue):
            return NotImplemented
        return self._state() == other._state()

    __hash__ = None  # mutable

    def _state(self) -> tuple:
        return self.policy, list(self._lru), self._key, self._hits, self._born

    def __len__(self) -> int:
        return len(self._lru) if self.policy == "lru" else len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._lru if self.policy == "lru" else block in self._key

    def push(self, block: int) -> None:
        """``block``'s ref count dropped to 0: it becomes evictable (it keeps its cached content)."""
        now = next(self._clock)
        if self.policy == "lru":
            self._lru[block] = None
            return
        key = (self._hits.get(block, 0), now) if self.policy == "lfu" else (self._born.get(block, -1), now)
        self._key[block] = key
        heapq.heappush(self._heap, (key, block))

    def remove(self, block: int) -> None:
        """``block`` is revived by a prefix hit (ref count 0 -> 1); counts the hit for ``lfu``."""
        self._hits[block] = self._hits.get(block, 0) + 1
        if self.policy == "lru":
            del self._lru[block]
        else:
            del self._key[block]  # its heap entry becomes stale

    def pop(self) -> int:
        """Evict: the next block to reuse for new content (its hit count and age restart).

        Raises:
            IndexError: the queue is empty.
        """
        if self.policy == "lru":
            block, _ = self._lru.popitem(last=False)
        else:
            while True:
                key, block = heapq.heappop(self._heap)
                if self._key.get(block) == key:
                    del self._key[block]
                    break
        self._hits[block] = 0
        self._born[block] = next(self._clock)
        return block

    def count_hit(self, block: int) -> None:
        """A prefix hit on an owned block (shared by another request): counts for ``lfu``."""
        self._hits[block] = self._hits.get(block, 0) + 1
