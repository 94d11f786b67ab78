"""Paged KV-cache block pool with automatic prefix caching (vLLM V1 ``KVCacheManager`` + ``BlockPool``).

Sources: PagedAttention (Kwon et al., SOSP'23, Sec. 4: block tables, ref-counted shared blocks),
vLLM's automatic prefix caching design (full blocks keyed by a chained hash of their tokens, free
blocks kept hittable in an LRU free queue until evicted) and vLLM's hybrid KV-cache manager (one block
table per KV cache group, out-of-window blocks of sliding groups released to the null block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import KVAllocator, KVCacheGroup, KVCacheStats
from plugins.kv_allocators._cache_hit import longest_cache_hit
from plugins.kv_allocators._eviction import EVICTION_POLICIES, FreeBlockQueue

if TYPE_CHECKING:
    from framework.config import EngineConfig


class PagedKVAllocator(KVAllocator):
    """Ref-counted block pool; full blocks are published to a prefix cache and reused across requests.

    State (O(1) per block; O(log n) eviction for ``lfu``/``fifo``):

    * ``ref_cnt[b]``: number of request block tables that contain block ``b``.
    * free queue: blocks with ``ref_cnt == 0`` in eviction order (``plugins/kv_allocators/_eviction.py``:
      ``lru`` least recently freed, ``fifo`` oldest content, ``lfu`` fewest hits). Under ``lru`` a
      request's blocks are freed in reverse table order, so a sequence's tail is evicted before its
      prefix. A free block keeps its hash (it can still be hit) until it is popped for a new
      allocation.
    * prefix cache ``(group, hash) -> block``: block hash = ``hash((parent_hash, tuple(block_tokens)))``
      with ``parent_hash = None`` for the first block (Python's built-in hash of int tuples is
      deterministic; a 64-bit collision would alias two prefixes, accepted as in vLLM's default); the
      KV cache group is part of the key (the same tokens hold other layers' K/V in another group).
    * one block table per KV cache group (``supports_kv_cache_groups``): at each allocation a sliding
      group releases the blocks wholly before the window of the request's first new token
      (:meth:`KVCacheGroup.num_skipped_blocks`), the entries becoming :attr:`null_block` (always a
      prefix of the table); released blocks join the free queue still hittable, like freed ones. A
      prefix hit needs, per sliding group, only the window's blocks before the hit point
      (``plugins/kv_allocators/_cache_hit.py``).

    Hit-rate statistics: each :meth:`get_computed_blocks` call adds ``request.num_tokens`` to
    ``prefix_queries_tokens`` and ``hit_blocks * block_size`` to ``prefix_hits_tokens``; a request
    whose admission is retried is counted once per lookup (as vLLM's ``PrefixCacheStats``).

    Args:
        num_blocks: blocks in the pool, ids ``0 .. num_blocks - 1``.
        block_size: tokens per block.
        enable_prefix_caching: publish full blocks and serve prefix hits.
        eviction: which cached free block is reused first, ``lru`` (default), ``lfu`` or ``fifo``
            (``kv_cache.params.eviction``).
        kv_cache_groups: block tables per request and their windows (default: one full-attention group).

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or an unknown ``eviction`` policy.
        TypeError: unknown keyword parameters (from the base class).
    """

    name = "paged"
    supports_kv_cache_groups = True

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Reject an unknown ``kv_cache.params.eviction`` before the model loads."""
        problems = super().validate(config)
        eviction = config.kv_allocator_params.get("eviction", "lru")
        if eviction not in EVICTION_POLICIES:
            problems.append(f"unknown eviction policy {eviction!r}; use kv_cache.params.eviction="
                            f"{'|'.join(EVICTION_POLICIES)}")
        return problems

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction: str = "lru", kv_cache_groups: Sequence[KVCacheGroup] | None = None, **params: Any) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, kv_cache_groups=kv_cache_groups, **params)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._ref_cnt: list[int] = [0] * num_blocks
        self._block_hash: list[tuple[int, int] | None] = [None] * num_blocks  # its prefix-cache key
        self._free_queue = FreeBlockQueue(eviction, range(num_blocks))  # raises on an unknown policy
        self._cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block id
        self._tables: dict[str, list[list[int]]] = {}  # request id -> per group: block ids in token order
        self._num_null: dict[str, list[int]] = {}  # request id -> per group: leading released (null) entries
        self._num_published: dict[str, list[int]] = {}  # request id -> per group: leading blocks already published
        self._req_hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._num_tokens: dict[str, int] = {}  # request id -> tokens its table covers (computed + scheduled)
        self._queries_tokens = 0
        self._hits_tokens = 0

    # ---- prefix cache ---------------------------------------------------------------------
    def _hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_full_blocks`` blocks of ``request.all_token_ids``,
        extended incrementally from the per-request cache. Returns the (possibly longer) cache.

        The chain starts from the request's LoRA adapter id (vLLM's block-hash "extra keys"), so one prompt under
        two adapters, or under an adapter and the base model, never shares a block: their K/V differ."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        lora = getattr(request, "lora_request", None)
        parent = hashes[-1] if hashes else (None if lora is None else ("lora", lora.lora_int_id))
        for i in range(len(hashes), num_full_blocks):
            parent = hash((parent, tuple(request.all_token_ids[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list, int]:
        """Longest run of cached blocks matching the start of ``request.all_token_ids`` that every KV
        cache group can serve (a sliding group only needs its window's blocks before the hit point).

        Called by the scheduler before admitting a waiting request. At most
        ``(num_tokens - 1) // block_size`` blocks are returned so that one token is left to compute.
        Takes no ownership and changes no state (hit-rate counters move at admission, in
        :meth:`allocate_slots`, so retried lookups are not double counted).

        Returns:
            ``(block_ids, num_hit_tokens)`` with ``num_hit_tokens = len(block_ids) * block_size``;
            ``([], 0)`` on a miss or when prefix caching is off. With several KV cache groups each
            entry is a tuple of the block in every group (:attr:`null_block` where it is not needed).
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        hashes = self._hashes(request, max_blocks)
        hits = longest_cache_hit(self.kv_cache_groups, lambda g, i: self._cached.get((g, hashes[i])), max_blocks,
                                 self.block_size, self.null_block)
        blocks = hits[0] if len(hits) == 1 else list(zip(*hits))
        return blocks, len(blocks) * self.block_size

    def _per_group(self, new_computed_blocks: list | None) -> list[list[int]]:
        """:meth:`get_computed_blocks`' entries as one list of block ids per group."""
        computed = new_computed_blocks or []
        if len(self.kv_cache_groups) == 1:
            return [list(computed)]
        return [[entry[g] for entry in computed] for g in range(len(self.kv_cache_groups))]

    def _publish_full_blocks(self, request: Request, g: int, num_total_tokens: int) -> None:
        """Hash and cache group ``g``'s blocks that are full given ``num_total_tokens`` and whose tokens
        are all known (``all_token_ids`` may lag behind, e.g. speculative slots). A key that already
        maps to another block keeps its mapping; the duplicate stays unhashed. Null entries are skipped."""
        rid = request.request_id
        num_full = min(num_total_tokens, request.num_tokens) // self.block_size
        published = self._num_published[rid]
        if num_full <= published[g]:
            return
        hashes = self._hashes(request, num_full)
        table = self._tables[rid][g]
        for i in range(published[g], num_full):
            block = table[i]
            if block == self.null_block or self._block_hash[block] is not None:  # released, or a prefix hit
                continue
            key = (g, hashes[i])
            if key not in self._cached:
                self._cached[key] = block
                self._block_hash[block] = key
        published[g] = num_full

    # ---- ownership --------------------------------------------------------------------------
    def _num_to_allocate(self, request: Request, num_new_tokens: int, computed: list[list[int]]) -> int:
        """Free blocks :meth:`allocate_slots` would consume net: new blocks (null where a sliding group
        skips them) plus revived cached hits, minus the blocks its releases return to the free queue."""
        bs, rid = self.block_size, request.request_id
        start = request.num_computed_tokens + len(computed[0]) * bs  # first token to compute
        target = -(-(start + num_new_tokens) // bs)
        tables = self._tables.get(rid)
        net = 0
        for g, group in enumerate(self.kv_cache_groups):
            table = tables[g] if tables else []
            skip = group.num_skipped_blocks(start, bs)
            net += max(0, target - max(len(table) + len(computed[g]), skip))
            net += sum(1 for b in computed[g] if b != self.null_block and self._ref_cnt[b] == 0)
            if tables:
                released = table[self._num_null[rid][g]:skip]
                net -= sum(1 for b in released if self._ref_cnt[b] == 1)
        return net

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list | None = None) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed; changes nothing.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self._num_to_allocate(request, num_new_tokens, self._per_group(new_computed_blocks)) <= len(
            self._free_queue)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list | None = None) -> list[int] | None:
        """Grow the request's block tables to cover ``num_computed_tokens + len(new_computed_blocks)
        * block_size + num_new_tokens`` tokens.

        Called by the scheduler each step the request gets tokens. Precondition: ``new_computed_blocks``
        come from :meth:`get_computed_blocks` of this request with no allocation in between.
        On success it takes a reference on ``new_computed_blocks`` (pulling free ones out of the
        free queue), releases each sliding group's blocks that are out of the window of the first new
        token, pops the missing blocks from the free-queue head (evicting their hashes; entries a
        sliding group skips get the null block) and publishes newly full blocks to the prefix cache.

        Returns:
            The newly popped block ids (possibly empty), or ``None`` when the free queue is too
            short; then no state changed.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        computed = self._per_group(new_computed_blocks)
        rid, bs = request.request_id, self.block_size
        start = request.num_computed_tokens + len(computed[0]) * bs
        num_total = start + num_new_tokens
        if rid not in self._tables:  # admission (or re-admission after preemption)
            if self.enable_prefix_caching:  # count the lookup once
                self._queries_tokens += request.num_tokens
                self._hits_tokens += len(computed[0]) * bs
            self._take_hits(rid, computed)
        self._num_tokens[rid] = num_total
        for g, group in enumerate(self.kv_cache_groups):
            self._release(rid, g, group.num_skipped_blocks(start, bs))
        new_blocks = []
        for g, group in enumerate(self.kv_cache_groups):  # after every release: one group's frees serve another
            table, skip = self._tables[rid][g], group.num_skipped_blocks(start, bs)
            for i in range(len(table), -(-num_total // bs)):
                if i < skip:  # nothing before it is held: the null prefix grows
                    table.append(self.null_block)
                    self._num_null[rid][g] = i + 1
                else:
                    table.append(self._pop_free_block())
                    new_blocks.append(table[-1])
            if self.enable_prefix_caching:
                self._publish_full_blocks(request, g, num_total)
        return new_blocks

    def _take_hits(self, rid: str, computed: list[list[int]]) -> None:
        """A fresh request's tables start as its prefix-cache hit: references taken, published already."""
        self._tables[rid] = [list(hit) for hit in computed]
        self._num_null[rid] = [sum(1 for b in hit if b == self.null_block) for hit in computed]
        self._num_published[rid] = [len(hit) for hit in computed]
        for block in (b for hit in computed for b in hit if b != self.null_block):
            if self._ref_cnt[block] == 0:
                self._free_queue.remove(block)
            else:
                self._free_queue.count_hit(block)
            self._ref_cnt[block] += 1

    def _release(self, rid: str, g: int, num_skipped: int) -> None:
        """Release group ``g``'s blocks before ``num_skipped`` (out of every query's window from now on),
        newest first; their entries become the null block. Released blocks keep their hash (written K/V)."""
        table, nulls = self._tables[rid][g], self._num_null[rid]
        end = min(num_skipped, len(table))
        for i in range(end - 1, nulls[g] - 1, -1):
            block, table[i] = table[i], self.null_block
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                self._free_queue.push(block)
        nulls[g] = max(nulls[g], end)

    def _pop_free_block(self) -> int:
        """Take the next block in eviction order, evicting its prefix-cache entry; ref count -> 1."""
        block = self._free_queue.pop()
        self._unpublish(block)
        self._ref_cnt[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks reaching zero join the free-queue tail in reverse
        table order, group by group (tail of the sequence evicted first). Cached blocks stay hittable.
        Unknown or already-freed requests are a no-op. Also forgets the request's cached block hashes.

        Precondition: ``request.num_computed_tokens`` still counts the tokens whose K/V were
        written (the scheduler frees before resetting it on preemption). Blocks past that written
        frontier were published by :meth:`allocate_slots` for a forward that will now not run
        for this request (a same-step preemption or an abort), so they are unpublished: a later
        prefix hit on them would read K/V that was never computed. No other request can hold
        them: admissions (the only way to hit a block) stop once a running request was preempted
        in the step, and the shadow-cache simulation checks it."""
        rid = request.request_id
        tables = self._tables.pop(rid, None)
        nulls = self._num_null.pop(rid, None)
        self._num_published.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._num_tokens.pop(rid, None)
        num_written = request.num_computed_tokens // self.block_size
        for table, num_null in zip(tables or (), nulls or ()):
            for i in range(len(table) - 1, num_null - 1, -1):
                block = table[i]
                self._ref_cnt[block] -= 1
                if self._ref_cnt[block] == 0:
                    if i >= num_written:  # published for this step's forward, which will not write it
                        self._unpublish(block)
                    self._free_queue.push(block)

    def _unpublish(self, block: int) -> None:
        """Drop ``block``'s prefix-cache entry (its K/V was never written, or it is reused)."""
        key = self._block_hash[block]
        if key is not None:
            if self._cached.get(key) == block:
                del self._cached[key]
            self._block_hash[block] = None

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's (first group's) block table in token order (live list; ``[]`` for unknown ids)."""
        tables = self._tables.get(request_id)
        return tables[0] if tables else []

    def get_block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """Every group's block table (live lists; empty lists for unknown ids)."""
        tables = self._tables.get(request_id)
        return tuple(tables) if tables else tuple([] for _ in self.kv_cache_groups)

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Blocks held per group (table length minus the released prefix)."""
        tables = self._tables.get(request_id)
        if not tables:
            return (0,) * len(self.kv_cache_groups)
        return tuple(len(t) - n for t, n in zip(tables, self._num_null[request_id]))

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached-but-free ones included (all allocatable now)."""
        return len(self._free_queue)

    def stats(self) -> KVCacheStats:
        """Pool size, free blocks and cumulative prefix-cache token counters (see class doc); reserved
        slots count held blocks, used slots the tokens each group still keeps."""
        bs, reserved, used = self.block_size, 0, 0
        for rid, tables in self._tables.items():
            for table, num_null in zip(tables, self._num_null[rid]):
                reserved += bs * (len(table) - num_null)
                used += max(0, self._num_tokens.get(rid, 0) - bs * num_null)
        return KVCacheStats(num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks,
                            prefix_queries_tokens=self._queries_tokens, prefix_hits_tokens=self._hits_tokens,
                            num_reserved_slots=reserved, num_used_slots=used)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; refused (returns False) while any block is owned.

        Hit-rate counters and the free-queue order are kept."""
        if len(self._free_queue) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash and cache the request's unhashed full blocks among its first ``num_tokens`` tokens, every group (a
        key that already maps to another block keeps its mapping); no-op without prefix caching or for a request
        that holds nothing."""
        tables = self._tables.get(request.request_id)
        if not self.enable_prefix_caching or not tables:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        hashes = self._hashes(request, num_full)
        for g, table in enumerate(tables):
            for i, block in enumerate(table[:num_full]):
                key = (g, hashes[i])
                if block != self.null_block and self._block_hash[block] is None and key not in self._cached:
                    self._cached[key] = block
                    self._block_hash[block] = key

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Unhash these blocks (ids outside the pool are ignored); owners and free-queue places are unchanged."""
        for block in block_ids:
            if 0 <= block < self.num_blocks:
                self._unpublish(block)

    # ---- debugging ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool is consistent (used by tests and the engine-test leak fixture).

        Checks: ``ref_cnt[b]`` equals the number of tables containing ``b``; ``b`` is in the free
        queue iff ``ref_cnt[b] == 0``; no table repeats a block; null entries are exactly each table's
        released prefix (only in sliding groups); prefix-cache entries and block hashes are a bijection
        (a hashed block is the one its key maps to); free + distinct owned blocks == ``num_blocks``.

        Raises:
            AssertionError: naming the first violated invariant.
        """
        owners = [0] * self.num_blocks
        for rid, tables in self._tables.items():
            for g, (table, num_null) in enumerate(zip(tables, self._num_null[rid])):
                held = table[num_null:]
                assert table[:num_null] == [self.null_block] * num_null and self.null_block not in held, (
                    f"request {rid!r} group {g}: null entries {table} are not its released prefix of {num_null}")
                assert not num_null or self.kv_cache_groups[g].sliding_window is not None, (
                    f"request {rid!r} released blocks of full-attention group {g}")
                assert len(set(held)) == len(held), f"request {rid!r} holds a block twice: {table}"
                for block in held:
                    assert 0 <= block < self.num_blocks, f"request {rid!r} holds invalid block {block}"
                    owners[block] += 1
        for block in range(self.num_blocks):
            assert self._ref_cnt[block] == owners[block], (
                f"block {block}: ref_cnt {self._ref_cnt[block]} != {owners[block]} owning tables")
            assert (block in self._free_queue) == (owners[block] == 0), (
                f"block {block}: in free queue={block in self._free_queue} but ref_cnt={owners[block]}")
        for key, block in self._cached.items():
            assert self._block_hash[block] == key, f"cache entry for block {block} has a stale hash"
        for block, key in enumerate(self._block_hash):
            assert key is None or self._cached.get(key) == block, (
                f"block {block} carries a hash the prefix cache does not map to it")
        num_owned = sum(1 for n in owners if n > 0)
        assert len(self._free_queue) + num_owned == self.num_blocks, (
            f"{len(self._free_queue)} free + {num_owned} owned != {self.num_blocks} blocks")


@hookimpl
def register_kv_allocators(register: Register) -> None:
    """Register ``paged``."""
    register("paged", PagedKVAllocator)
