"""RadixAttention: a radix tree over token sequences whose nodes own KV blocks (Zheng et al. 2024,
"SGLang: Efficient Execution of Structured Language Model Programs", Sec. 3).

Mapping token-granular matching onto paged blocks: every edge label is a sequence of *whole
blocks* of tokens (one ``block_size`` tuple per block, the node owning one KV block per tuple), so a
match ends at a block boundary, as in vLLM's block-hash cache. ``engine.block_size=1`` makes the
tree token-granular like SGLang's (which stores one KV slot per token); a larger block trades the
last partial block of every shared prefix for cheaper bookkeeping (``docs/results`` reports the
hit-rate difference). Operations, as in the paper:

* match: walk from the root comparing block tuples (``get_computed_blocks``, read-only);
* insert with edge splits: a request's blocks join the tree once their K/V is *written* (at its
  next ``allocate_slots`` and when it is freed, SGLang's ``cache_unfinished_req`` /
  ``cache_finished_req``), so the tree never holds uncomputed K/V; a block whose content another
  request inserted first stays private to its request and is freed with it;
* lock/unlock: a running request locks its deepest node, which pins every ancestor
  (``lock_ref`` counts locks in the subtree); a locked node is never evicted;
* eviction: leaf-first, least recently used, one block at a time from a leaf's tail.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import KVAllocator, KVCacheStats

_NEVER = 1 << 62  # "inserted up to" marker of a request whose insertion stopped at a duplicate


class _Node:
    """A radix-tree node: an edge of whole blocks from its parent, one KV block per block tuple."""

    __slots__ = ("parent", "children", "keys", "blocks", "lock_ref", "last_access")

    def __init__(self, parent: _Node | None, keys: list[tuple[int, ...]], blocks: list[int], now: int) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}  # first block tuple of the child's edge -> child
        self.keys = keys  # the edge label: token tuples, one per block
        self.blocks = blocks  # KV block ids, aligned with keys
        self.lock_ref = 0  # locks held in this node's subtree (running requests pinning it)
        self.last_access = now  # logical clock of the last lock/unlock through it (LRU)


class RadixKVAllocator(KVAllocator):
    """Block pool whose cached prefixes live in a radix tree (SGLang's ``RadixCache`` over pages).

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block (= tokens per radix edge element).
        enable_prefix_caching: match and insert; off, every block is private to its request.

    Raises:
        ValueError: ``num_blocks < 1`` or ``block_size < 1``.
    """

    name = "radix"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, **params: Any) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, **params)
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self._clock = itertools.count(1)
        self._root = _Node(None, [], [], 0)
        self._free: deque[int] = deque(range(num_blocks))
        self._tree_node: dict[int, _Node] = {}  # block in the tree -> its node
        self._num_evictable = 0  # tree blocks in nodes with lock_ref == 0
        self._leaves: list[tuple[int, int, _Node]] = []  # (last_access, tie, node) eviction candidates (lazy)
        self._tables: dict[str, list[int]] = {}
        self._private: dict[str, set[int]] = {}  # request -> its blocks not owned by the tree
        self._locked: dict[str, _Node] = {}  # request -> deepest node it locks (root: none)
        self._num_inserted: dict[str, int] = {}  # request -> leading table blocks already in/through the tree
        self._num_tokens: dict[str, int] = {}
        self._queries_tokens = 0
        self._hits_tokens = 0

    # ---- tree primitives ----------------------------------------------------------------------
    def _block_keys(self, request: Request, num_blocks: int) -> list[tuple[int, ...]]:
        bs, ids = self.block_size, request.all_token_ids
        return [tuple(ids[i * bs:(i + 1) * bs]) for i in range(num_blocks)]

    def _match(self, keys: list[tuple[int, ...]]) -> tuple[_Node, int, list[int]]:
        """Walk the tree along ``keys``: ``(node, matched blocks in node, blocks on the path)``."""
        node, blocks, i = self._root, [], 0
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            j = 0
            while j < len(child.keys) and i < len(keys) and child.keys[j] == keys[i]:
                blocks.append(child.blocks[j])
                i, j = i + 1, j + 1
            node = child
            if j < len(child.keys):
                return node, j, blocks
        return node, len(node.keys), blocks

    def _split(self, node: _Node, j: int) -> _Node:
        """Split ``node``'s edge after ``j`` blocks; returns the upper part (keeps the parent link)."""
        if j == len(node.keys):
            return node
        lower = _Node(node, node.keys[j:], node.blocks[j:], node.last_access)
        lower.children, lower.lock_ref = node.children, node.lock_ref
        for child in lower.children.values():
            child.parent = lower
        for block in lower.blocks:
            self._tree_node[block] = lower
        node.keys, node.blocks, node.children = node.keys[:j], node.blocks[:j], {lower.keys[0]: lower}
        for rid, locked in self._locked.items():  # a lock on the whole edge now ends at its lower part
            if locked is node:
                self._locked[rid] = lower
        if not lower.children and not lower.lock_ref:
            self._push_leaf(lower)  # the old heap entry points at the upper part, now an inner node
        return node

    def _lock(self, node: _Node, delta: int) -> None:
        """Add ``delta`` (+1/-1) to the lock count of ``node`` and its ancestors; track evictability."""
        now = next(self._clock)
        while node is not self._root:
            before = node.lock_ref
            node.lock_ref += delta
            node.last_access = now
            if before == 0 and node.lock_ref > 0:
                self._num_evictable -= len(node.blocks)
            elif before > 0 and node.lock_ref == 0:
                self._num_evictable += len(node.blocks)
                if not node.children:
                    self._push_leaf(node)
            node = node.parent

    def _push_leaf(self, node: _Node) -> None:
        heapq.heappush(self._leaves, (node.last_access, next(self._clock), node))

    def _evict_block(self) -> int:
        """Remove the tail block of the least recently used unlocked leaf and return it."""
        while True:
            stamp, _, node = heapq.heappop(self._leaves)
            if node.lock_ref or node.children or not node.blocks or stamp != node.last_access:
                continue  # stale entry
            first_key = node.keys[0]
            node.keys.pop()
            block = node.blocks.pop()
            del self._tree_node[block]
            self._num_evictable -= 1
            if node.blocks:
                self._push_leaf(node)
            else:
                parent = node.parent
                del parent.children[first_key]
                if parent is not self._root and not parent.children and not parent.lock_ref:
                    self._push_leaf(parent)
            return block

    def _take_block(self) -> int:
        return self._free.popleft() if self._free else self._evict_block()

    def _insert_written(self, request: Request, num_blocks: int) -> None:
        """Insert the request's table blocks up to ``num_blocks`` (all written, all full) into the tree,
        moving its lock down to the deepest node. At the first block whose content another request
        inserted first, insertion stops for good: that block and the rest stay private (freed with
        the request) — a rare race of two requests computing the same prefix at once."""
        rid = request.request_id
        start = self._num_inserted[rid]
        if not self.enable_prefix_caching or num_blocks <= start:
            return
        table, node = self._tables[rid], self._locked[rid]
        for i, key in zip(range(start, num_blocks), self._block_keys(request, num_blocks)[start:]):
            if key in node.children:
                # another request inserted this content first: its copy serves future hits; ours (and
                # the rest of this request) stays private, so no unlocked node gets pinned here
                num_blocks = _NEVER
                break
            if node is not self._root and not node.children and node.lock_ref == 1:
                node.keys.append(key)  # extend our own leaf edge (path compression)
                node.blocks.append(table[i])
                self._tree_node[table[i]] = node
                self._private[rid].discard(table[i])
                continue
            child = _Node(node, [key], [table[i]], next(self._clock))
            node.children[key] = child
            self._tree_node[table[i]] = child
            self._private[rid].discard(table[i])
            self._num_evictable += 1  # an unlocked node's block is evictable; the lock below pins it
            self._lock(child, +1)
            if node is not self._root:
                self._lock(node, -1)
            node = child
        self._locked[rid] = node
        self._num_inserted[rid] = num_blocks

    # ---- KVAllocator ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Blocks of the longest cached block-aligned prefix; leaves >= 1 token to compute; read-only."""
        if not self.enable_prefix_caching:
            return [], 0
        num = max(0, (request.num_tokens - 1) // self.block_size)
        _, _, blocks = self._match(self._block_keys(request, num))
        return blocks, len(blocks) * self.block_size

    def _num_needed(self, request: Request, num_new_tokens: int, computed: list[int]) -> int:
        num_total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        owned = len(self._tables.get(request.request_id, ())) + len(computed)
        return max(0, -(-num_total // self.block_size) - owned)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[int] | None = None) -> bool:
        """Whether :meth:`allocate_slots` would succeed: free blocks plus evictable tree blocks,
        minus the hit blocks it would lock. Changes nothing.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed = new_computed_blocks or []
        pinned = sum(1 for b in computed if self._tree_node[b].lock_ref == 0)
        return self._num_needed(request, num_new_tokens, computed) <= len(self._free) + self._num_evictable - pinned

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Lock the hit path (first call), insert blocks written so far, then add fresh blocks
        (evicting LRU leaves when the free list is empty).

        Returns:
            The new block ids, or ``None`` (nothing changed) when the pool cannot cover the request.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        computed = new_computed_blocks or []
        rid = request.request_id
        num_needed = self._num_needed(request, num_new_tokens, computed)
        if rid not in self._tables:
            self._admit(request, computed)
        # blocks already in the table whose K/V is written (a swapped-in request's blocks come later)
        num_written = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        self._insert_written(request, min(num_written, len(self._tables[rid])))
        new = [self._take_block() for _ in range(num_needed)]
        self._tables[rid].extend(new)
        self._private[rid].update(new)
        self._num_tokens[rid] = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return new

    def _admit(self, request: Request, computed: list[int]) -> None:
        rid = request.request_id
        node = self._root
        if computed:
            node, j, _ = self._match(self._block_keys(request, len(computed)))
            node = self._split(node, j)
            self._lock(node, +1)
        if self.enable_prefix_caching:
            self._queries_tokens += request.num_tokens
            self._hits_tokens += len(computed) * self.block_size
        self._tables[rid] = list(computed)
        self._private[rid] = set()
        self._locked[rid] = node
        self._num_inserted[rid] = len(computed)

    def free(self, request: Request) -> None:
        """Insert the request's written full blocks (``num_computed_tokens`` still counts written
        tokens), unlock its path and return its private blocks. Unknown ids are a no-op."""
        rid = request.request_id
        if rid not in self._tables:
            return
        num_written = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        self._insert_written(request, min(num_written, len(self._tables[rid])))
        node = self._locked.pop(rid)
        if node is not self._root:
            self._lock(node, -1)
        self._free.extend(sorted(self._private.pop(rid)))
        del self._tables[rid], self._num_inserted[rid]
        self._num_tokens.pop(rid, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (live list; ``[]`` for unknown ids)."""
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        """Free blocks plus unlocked (evictable) tree blocks."""
        return len(self._free) + self._num_evictable

    def stats(self) -> KVCacheStats:
        """Usage, prefix-cache counters (once per admission) and reserved/used slots."""
        return KVCacheStats(num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks,
                            prefix_queries_tokens=self._queries_tokens, prefix_hits_tokens=self._hits_tokens,
                            num_reserved_slots=self.block_size * sum(map(len, self._tables.values())),
                            num_used_slots=sum(self._num_tokens.values()))

    def reset_prefix_cache(self) -> bool:
        """Drop the whole tree (only when no request holds blocks)."""
        if self._tables:
            return False
        self._free.extend(sorted(self._tree_node))
        self._tree_node.clear()
        self._root.children.clear()
        self._leaves.clear()
        self._num_evictable = 0
        return True

    def check_invariants(self) -> None:
        """Assert: every block is in exactly one of free list / tree / one request's private set;
        lock counts equal the locks in each subtree; the evictable count matches; edges are aligned.

        Raises:
            AssertionError: naming the first violated invariant.
        """
        seen: dict[int, str] = {}

        def claim(block: int, where: str) -> None:
            assert block not in seen, f"block {block} is both {seen[block]} and {where}"
            seen[block] = where

        for block in self._free:
            claim(block, "free")
        for rid, private in self._private.items():
            for block in private:
                claim(block, f"private to {rid}")
        direct: dict[int, int] = {}
        for node in self._locked.values():
            direct[id(node)] = direct.get(id(node), 0) + 1
        evictable = self._check_subtree(self._root, claim, direct)
        assert evictable == self._num_evictable, f"evictable count {self._num_evictable} != {evictable}"
        assert len(seen) == self.num_blocks, f"{self.num_blocks - len(seen)} blocks leaked"
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"{rid} holds a block twice"
            for block in table:
                assert block in self._private[rid] or block in self._tree_node, f"{rid} holds free block {block}"
                if block in self._tree_node:
                    assert self._tree_node[block].lock_ref > 0, f"{rid} uses unlocked tree block {block}"

    def _check_subtree(self, node: _Node, claim: Any, direct: dict[int, int]) -> int:
        assert len(node.keys) == len(node.blocks), "edge keys and blocks misaligned"
        locks, evictable = direct.get(id(node), 0), 0
        for key, child in node.children.items():
            assert child.parent is node and child.keys and child.keys[0] == key, "child keyed by a wrong edge"
            evictable += self._check_subtree(child, claim, direct)
            locks += child.lock_ref
        for block in node.blocks:
            claim(block, "in the tree")
            assert self._tree_node[block] is node, f"block {block} maps to the wrong node"
        if node is not self._root:
            assert node.lock_ref == locks, f"lock_ref {node.lock_ref} != {locks} locks in subtree"
            evictable += 0 if node.lock_ref else len(node.blocks)
        return evictable


@hookimpl
def register_kv_allocators(register: Register) -> None:
    """Register ``radix``."""
    register("radix", RadixKVAllocator)
