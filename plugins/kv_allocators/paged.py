"""Paged KV-cache block pool with automatic prefix caching (vLLM V1 ``KVCacheManager`` + ``BlockPool``).

Sources: PagedAttention (Kwon et al., SOSP'23, Sec. 4: block tables, ref-counted shared blocks) and
vLLM's automatic prefix caching design (full blocks keyed by a chained hash of their tokens, free
blocks kept hittable in an LRU free queue until evicted).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from framework import hookimpl
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import KVAllocator, KVCacheStats
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
    * prefix cache ``hash -> block``: block hash = ``hash((parent_hash, tuple(block_tokens)))``
      with ``parent_hash = None`` for the first block (Python's built-in hash of int tuples is
      deterministic; a 64-bit collision would alias two prefixes, accepted as in vLLM's default).

    Hit-rate statistics: each :meth:`get_computed_blocks` call adds ``request.num_tokens`` to
    ``prefix_queries_tokens`` and ``hit_blocks * block_size`` to ``prefix_hits_tokens``; a request
    whose admission is retried is counted once per lookup (as vLLM's ``PrefixCacheStats``).

    Args:
        num_blocks: blocks in the pool, ids ``0 .. num_blocks - 1``.
        block_size: tokens per block.
        enable_prefix_caching: publish full blocks and serve prefix hits.
        eviction: which cached free block is reused first, ``lru`` (default), ``lfu`` or ``fifo``
            (``kv_cache.params.eviction``).

    Raises:
        ValueError: ``num_blocks < 1``, ``block_size < 1`` or an unknown ``eviction`` policy.
        TypeError: unknown keyword parameters (from the base class).
    """

    name = "paged"

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
                 eviction: str = "lru", **params: Any) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, **params)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._ref_cnt: list[int] = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._free_queue = FreeBlockQueue(eviction, range(num_blocks))  # raises on an unknown policy
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._tables: dict[str, list[int]] = {}  # request id -> block ids in token order
        self._num_published: dict[str, int] = {}  # request id -> leading table blocks already published
        self._req_hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        self._num_tokens: dict[str, int] = {}  # request id -> tokens its table covers (computed + scheduled)
        self._queries_tokens = 0
        self._hits_tokens = 0

    # ---- prefix cache ---------------------------------------------------------------------
    def _hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first ``num_full_blocks`` blocks of ``request.all_token_ids``,
        extended incrementally from the per-request cache. Returns the (possibly longer) cache."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full_blocks):
            parent = hash((parent, tuple(request.all_token_ids[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks matching the start of ``request.all_token_ids``.

        Called by the scheduler before admitting a waiting request. At most
        ``(num_tokens - 1) // block_size`` blocks are returned so that one token is left to compute.
        Takes no ownership and changes no state (hit-rate counters move at admission, in
        :meth:`allocate_slots`, so retried lookups are not double counted).

        Returns:
            ``(block_ids, num_hit_tokens)`` with ``num_hit_tokens = len(block_ids) * block_size``;
            ``([], 0)`` on a miss or when prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (request.num_tokens - 1) // self.block_size)
        hashes = self._hashes(request, max_blocks)
        blocks: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _publish_full_blocks(self, request: Request, table: list[int], num_total_tokens: int) -> None:
        """Hash and cache the blocks of ``table`` that are full given ``num_total_tokens`` and whose
        tokens are all known (``all_token_ids`` may lag behind, e.g. speculative slots). A hash that
        already maps to another block keeps its mapping; the duplicate stays unhashed."""
        rid = request.request_id
        num_full = min(num_total_tokens, request.num_tokens) // self.block_size
        start = self._num_published.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for i in range(start, num_full):
            block = table[i]
            if self._block_hash[block] is not None:  # a prefix-cache hit: already published
                continue
            if hashes[i] not in self._cached:
                self._cached[hashes[i]] = block
                self._block_hash[block] = hashes[i]
        self._num_published[rid] = num_full

    # ---- ownership --------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[int] | None = None) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed; changes nothing.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed = new_computed_blocks or []
        num_total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_owned = len(self._tables.get(request.request_id, ())) + len(computed)
        num_needed = max(0, -(-num_total // self.block_size) - num_owned)
        num_revived = sum(1 for b in computed if self._ref_cnt[b] == 0)  # cached blocks now in the free queue
        return num_needed + num_revived <= len(self._free_queue)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[int] | None = None) -> list[int] | None:
        """Grow the request's block table to cover ``num_computed_tokens + len(new_computed_blocks)
        * block_size + num_new_tokens`` tokens.

        Called by the scheduler each step the request gets tokens. Precondition: ``new_computed_blocks``
        come from :meth:`get_computed_blocks` of this request with no allocation in between.
        On success it takes a reference on ``new_computed_blocks`` (pulling free ones out of the
        free queue), pops the missing blocks from the free-queue head (evicting their hashes) and
        publishes newly full blocks to the prefix cache.

        Returns:
            The newly popped block ids (possibly empty), or ``None`` when the free queue is too
            short; then no state changed.

        Raises:
            ValueError: ``num_new_tokens < 0``.
        """
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            return None
        computed = new_computed_blocks or []
        rid = request.request_id
        num_total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_needed = max(0, -(-num_total // self.block_size) - len(self._tables.get(rid, ())) - len(computed))
        if rid not in self._tables and self.enable_prefix_caching:  # admission: count the lookup once
            self._queries_tokens += request.num_tokens
            self._hits_tokens += len(computed) * self.block_size

        self._num_tokens[rid] = num_total
        table = self._tables.setdefault(rid, [])
        for block in computed:
            if self._ref_cnt[block] == 0:
                self._free_queue.remove(block)
            else:
                self._free_queue.count_hit(block)
            self._ref_cnt[block] += 1
        table.extend(computed)
        if len(table) == len(computed):  # a fresh table: the hit blocks are published already
            self._num_published[rid] = len(computed)
        new_blocks = [self._pop_free_block() for _ in range(num_needed)]
        table.extend(new_blocks)
        if self.enable_prefix_caching:
            self._publish_full_blocks(request, table, num_total)
        return new_blocks

    def _pop_free_block(self) -> int:
        """Take the next block in eviction order, evicting its prefix-cache entry; ref count -> 1."""
        block = self._free_queue.pop()
        self._unpublish(block)
        self._ref_cnt[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks reaching zero join the free-queue tail in reverse
        table order (tail of the sequence evicted first). Cached blocks stay hittable. Unknown or
        already-freed requests are a no-op. Also forgets the request's cached block hashes.

        Precondition: ``request.num_computed_tokens`` still counts the tokens whose K/V were
        written (the scheduler frees before resetting it on preemption). Blocks past that written
        frontier were published by :meth:`allocate_slots` for a forward that will now not run
        for this request (a same-step preemption or an abort), so they are unpublished: a later
        prefix hit on them would read K/V that was never computed. No other request can hold
        them: admissions (the only way to hit a block) stop once a running request was preempted
        in the step, and the shadow-cache simulation checks it."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._num_published.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._num_tokens.pop(rid, None)
        num_written = request.num_computed_tokens // self.block_size
        for i in range(len(table or ()) - 1, -1, -1):
            block = table[i]
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                if i >= num_written:  # published for this step's forward, which will not write it
                    self._unpublish(block)
                self._free_queue.push(block)

    def _unpublish(self, block: int) -> None:
        """Drop ``block``'s prefix-cache entry (its K/V was never written)."""
        block_hash = self._block_hash[block]
        if block_hash is not None:
            if self._cached.get(block_hash) == block:
                del self._cached[block_hash]
            self._block_hash[block] = None

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table in token order (live list; a fresh ``[]`` for unknown ids)."""
        return self._tables.get(request_id, [])

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached-but-free ones included (all allocatable now)."""
        return len(self._free_queue)

    def stats(self) -> KVCacheStats:
        """Pool size, free blocks and cumulative prefix-cache token counters (see class doc)."""
        return KVCacheStats(num_blocks=self.num_blocks, num_free_blocks=self.num_free_blocks,
                            prefix_queries_tokens=self._queries_tokens, prefix_hits_tokens=self._hits_tokens,
                            num_reserved_slots=self.block_size * sum(map(len, self._tables.values())),
                            num_used_slots=sum(self._num_tokens.values()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; refused (returns False) while any block is owned.

        Hit-rate counters and the free-queue order are kept."""
        if len(self._free_queue) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    # ---- debugging ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the pool is consistent (used by tests and the engine-test leak fixture).

        Checks: ``ref_cnt[b]`` equals the number of tables containing ``b``; ``b`` is in the free
        queue iff ``ref_cnt[b] == 0``; no table repeats a block; prefix-cache entries and block hashes
        are a bijection (a hashed block is the one its hash maps to); free + distinct owned blocks
        == ``num_blocks``.

        Raises:
            AssertionError: naming the first violated invariant.
        """
        owners = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert len(set(table)) == len(table), f"request {rid!r} holds a block twice: {table}"
            for block in table:
                assert 0 <= block < self.num_blocks, f"request {rid!r} holds invalid block {block}"
                owners[block] += 1
        for block in range(self.num_blocks):
            assert self._ref_cnt[block] == owners[block], (
                f"block {block}: ref_cnt {self._ref_cnt[block]} != {owners[block]} owning tables")
            assert (block in self._free_queue) == (owners[block] == 0), (
                f"block {block}: in free queue={block in self._free_queue} but ref_cnt={owners[block]}")
        for block_hash, block in self._cached.items():
            assert self._block_hash[block] == block_hash, f"cache entry for block {block} has a stale hash"
        for block, block_hash in enumerate(self._block_hash):
            assert block_hash is None or self._cached.get(block_hash) == block, (
                f"block {block} carries a hash the prefix cache does not map to it")
        num_owned = sum(1 for n in owners if n > 0)
        assert len(self._free_queue) + num_owned == self.num_blocks, (
            f"{len(self._free_queue)} free + {num_owned} owned != {self.num_blocks} blocks")


@hookimpl
def register_kv_allocators(register: Register) -> None:
    """Register ``paged``."""
    register("paged", PagedKVAllocator)
