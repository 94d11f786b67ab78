"""Tests of ``plugins.kv_allocators.paged``: block accounting, LRU eviction, prefix caching, invariants."""

from __future__ import annotations

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from plugins.kv_allocators._eviction import EVICTION_POLICIES, FreeBlockQueue
from plugins.kv_allocators.paged import PagedKVAllocator, register_kv_allocators


def make_request(request_id: str, tokens: list[int]) -> Request:
    """A request with prompt ``tokens`` and default sampling."""
    return Request(request_id, list(tokens), SamplingParams())


def admit(kv: PagedKVAllocator, request: Request, num_new: int | None = None) -> list[int] | None:
    """Scheduler-style admission: prefix lookup, then allocate; on success advance computed tokens."""
    blocks, hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - hit if num_new is None else num_new
    new = kv.allocate_slots(request, num_new, blocks)
    if new is not None:
        request.num_computed_tokens = hit + num_new
    return new


def test_allocate_grows_table_by_whole_blocks() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=4)
    r = make_request("a", range(10))
    assert kv.allocate_slots(r, 10) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == []  # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(r, 3) == [3]
    assert kv.get_block_ids("missing") == []
    kv.check_invariants()


def test_shortage_returns_none_and_changes_nothing() -> None:
    kv = PagedKVAllocator(num_blocks=4, block_size=2)
    cached = make_request("c", [1, 2, 3, 4, 5])
    admit(kv, cached)  # blocks 0,1 full and cached, block 2 partial
    kv.free(cached)
    hog = make_request("h", [9])
    kv.allocate_slots(hog, 1)  # takes block 3; free queue now holds 2, 1, 0
    before = copy.deepcopy(kv.__dict__)
    r = make_request("r", [1, 2, 3, 4, 7, 7, 7, 7])
    blocks, hit = kv.get_computed_blocks(r)
    assert hit == 4
    # 2 revived cached blocks + 2 new blocks > 3 free blocks
    assert kv.allocate_slots(r, r.num_tokens - hit, blocks) is None
    before["_queries_tokens"], before["_hits_tokens"] = kv._queries_tokens, kv._hits_tokens
    before["_req_hashes"] = kv._req_hashes  # the lookup may memoize hashes; nothing else may change
    assert kv.__dict__ == before
    assert kv.allocate_slots(make_request("big", range(9)), 9) is None
    kv.check_invariants()


def test_free_returns_blocks_and_is_idempotent() -> None:
    kv = PagedKVAllocator(num_blocks=4, block_size=4)
    r = make_request("a", range(13))
    assert admit(kv, r) == [0, 1, 2, 3]
    assert kv.num_free_blocks == 0
    kv.free(r)
    assert kv.num_free_blocks == 4 and kv.get_block_ids("a") == []
    kv.free(r)
    kv.free(make_request("never", [1]))
    assert kv.num_free_blocks == 4
    kv.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_eviction_order_is_reverse_of_freed_table(caching: bool) -> None:
    kv = PagedKVAllocator(num_blocks=4, block_size=2, enable_prefix_caching=caching)
    r1 = make_request("r1", range(8))
    assert admit(kv, r1) == [0, 1, 2, 3]
    kv.free(r1)  # free queue: 3, 2, 1, 0
    assert kv.allocate_slots(make_request("x", [50]), 1) == [3]
    assert kv.allocate_slots(make_request("y", [60]), 1) == [2]
    blocks, hit = kv.get_computed_blocks(make_request("r3", [*range(8), 99]))
    # the tail of r1 was evicted first; its prefix is still hittable
    assert (blocks, hit) == (([0, 1], 4) if caching else ([], 0))


def test_prefix_hit_shares_blocks_between_requests() -> None:
    kv = PagedKVAllocator(num_blocks=16, block_size=4)
    prompt = [7, 3, 5, 1, 2, 8, 6, 4]
    r1 = make_request("r1", [*prompt, 9, 9])
    admit(kv, r1)
    r2 = make_request("r2", [*prompt, 1, 1, 1])
    blocks, hit = kv.get_computed_blocks(r2)
    assert blocks == kv.get_block_ids("r1")[:2] and hit == 8
    assert kv.allocate_slots(r2, r2.num_tokens - hit, blocks) == [3]
    assert kv.get_block_ids("r2") == [0, 1, 3]
    assert [kv._ref_cnt[b] for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_invariants()
    kv.free(r1)
    assert kv._ref_cnt[0] == 1 and kv.num_free_blocks == 16 - 3
    kv.free(r2)
    assert kv.num_free_blocks == 16
    kv.check_invariants()


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=4)
    admit(kv, make_request("r1", range(8)))
    blocks, hit = kv.get_computed_blocks(make_request("r2", range(8)))
    assert (len(blocks), hit) == (1, 4)  # (8 - 1) // 4 blocks: the last block is recomputed
    assert kv.get_computed_blocks(make_request("r3", range(9))) == (kv.get_block_ids("r1")[:2], 8)
    assert kv.get_computed_blocks(make_request("r4", [0])) == ([], 0)


def test_prefix_caching_off_never_hits() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=2, enable_prefix_caching=False)
    admit(kv, make_request("r1", range(6)))
    assert kv.get_computed_blocks(make_request("r2", range(6))) == ([], 0)
    stats = kv.stats()
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens, stats.hit_rate) == (0, 0, 0.0)
    assert not kv._cached


def test_hit_rate_counts_query_and_hit_tokens() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=4)
    admit(kv, make_request("r1", range(10)))  # query 10 tokens, miss
    admit(kv, make_request("r2", [*range(8), 5, 5]))  # query 10 tokens, hit 8
    stats = kv.stats()
    assert (stats.prefix_queries_tokens, stats.prefix_hits_tokens) == (20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert (stats.num_blocks, stats.num_free_blocks) == (8, 8 - 4)
    assert stats.usage == pytest.approx(0.5)


def test_reset_prefix_cache_only_when_nothing_owned() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=2)
    r1 = make_request("r1", range(6))
    admit(kv, r1)
    assert kv.reset_prefix_cache() is False
    kv.free(r1)
    assert kv.get_computed_blocks(make_request("q", range(6)))[1] == 4
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("q2", range(6))) == ([], 0)
    kv.check_invariants()


def test_speculative_slots_beyond_known_tokens_are_not_published() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=4)
    r = make_request("r", range(6))
    assert kv.allocate_slots(r, 6 + 3) == [0, 1, 2]  # 3 draft slots past all_token_ids
    assert kv._block_hash[0] is not None and kv._block_hash[1] is None
    r.num_computed_tokens = 6
    for t in (6, 7):
        r.append_output_token(t)
    assert kv.allocate_slots(r, 2) == []
    assert kv._block_hash[1] is not None  # now covered by real tokens
    kv.check_invariants()


def test_duplicate_content_keeps_first_mapping() -> None:
    kv = PagedKVAllocator(num_blocks=8, block_size=2)
    r1, r2 = make_request("r1", [1, 2, 3]), make_request("r2", [1, 2, 3])
    kv.allocate_slots(r1, 3)  # both compute the same block without a lookup
    kv.allocate_slots(r2, 3)
    assert kv._cached == {kv._block_hash[0]: 0} and kv._block_hash[2] is None
    kv.check_invariants()
    r1.num_computed_tokens = 3  # the forward wrote its K/V
    kv.free(r1)
    assert kv.get_computed_blocks(make_request("r3", [1, 2, 3]))[0] == [0]


def test_blocks_freed_before_their_forward_are_unpublished() -> None:
    """A request freed between allocate_slots and its forward (same-step preemption, abort) never
    wrote the blocks it published: they must not be prefix hits afterwards."""
    kv = PagedKVAllocator(num_blocks=8, block_size=2)
    r1 = make_request("r1", [1, 2, 3, 4, 5])
    assert admit(kv, r1, 2) == [0]  # first chunk: tokens 0-1, block 0 published
    assert kv.allocate_slots(r1, 2) == [1]  # second chunk scheduled: block 1 published for this step
    kv.free(r1)  # preempted before the forward: num_computed_tokens == 2
    assert kv.get_computed_blocks(make_request("r2", [1, 2, 3, 4, 5]))[0] == [0]
    kv.check_invariants()


def _cached_blocks(kv: PagedKVAllocator, *prompts: list[int]) -> list[Request]:
    """Admit, compute and free one request per prompt (each prompt = whole blocks, all cached)."""
    reqs = [make_request(f"c{i}", p) for i, p in enumerate(prompts)]
    for r in reqs:
        admit(kv, r)
        kv.free(r)
    return reqs


def test_lfu_queue_evicts_fewest_hits_then_least_recently_freed() -> None:
    q = FreeBlockQueue("lfu", range(3))
    for block, hits in ((0, 2), (2, 1)):
        for _ in range(hits):  # a prefix hit revives the block; the request later frees it again
            q.remove(block)
            q.push(block)
    assert [q.pop(), q.pop(), q.pop()] == [1, 2, 0]
    assert len(q) == 0


def test_lru_queue_evicts_least_recently_freed() -> None:
    q = FreeBlockQueue("lru", range(3))
    q.remove(0)
    q.push(0)
    assert [q.pop(), q.pop(), q.pop()] == [1, 2, 0]


def test_fifo_evicts_the_oldest_content_even_if_recently_freed() -> None:
    kv = PagedKVAllocator(num_blocks=4, block_size=2, eviction="fifo")
    _cached_blocks(kv, [1, 2], [3, 4], [5, 6])
    hit = make_request("h", [1, 2, 9])  # block 0 (oldest content) is used and freed last
    admit(kv, hit)
    kv.free(hit)
    new = make_request("new", [7])
    assert kv.allocate_slots(new, 1) == [0]  # lru would pick block 1


def test_unknown_eviction_policy() -> None:
    from framework import EngineConfig

    with pytest.raises(ValueError, match="lru|lfu|fifo"):
        PagedKVAllocator(num_blocks=4, block_size=2, eviction="random")
    problems = PagedKVAllocator.validate(EngineConfig(model="m", kv_allocator_params={"eviction": "mru"}))
    assert problems and "kv_cache.params.eviction" in problems[0]


def test_bad_parameters_raise() -> None:
    with pytest.raises(TypeError, match="unknown parameters"):
        PagedKVAllocator(num_blocks=4, block_size=4, watermark=0.1)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVAllocator(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVAllocator(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_new_tokens"):
        PagedKVAllocator(num_blocks=4, block_size=4).allocate_slots(make_request("r", [1]), -1)


def test_registers_under_its_name() -> None:
    seen: dict[str, type] = {}
    register_kv_allocators(lambda name, cls: seen.__setitem__(name, cls))
    assert seen == {"paged": PagedKVAllocator} and PagedKVAllocator.name == "paged"


class PagedAllocatorMachine(RuleBasedStateMachine):
    """A toy scheduler driving the allocator with colliding prompts, chunked prefill, decode,
    draft slots, preemption and finish. A shadow copy of each block's token content checks that a
    prefix hit returns blocks holding exactly the request's tokens and that no shared block is written."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: PagedKVAllocator | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.content: dict[int, list[int | None]] = {}
        self.num_added = 0

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4), caching=st.booleans(),
                eviction=st.sampled_from(EVICTION_POLICIES))
    def init_pool(self, num_blocks: int, block_size: int, caching: bool, eviction: str) -> None:
        self.kv = PagedKVAllocator(num_blocks, block_size, enable_prefix_caching=caching, eviction=eviction)
        self.content = {b: [None] * block_size for b in range(num_blocks)}

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def add_request(self, tokens: list[int]) -> None:
        self.waiting.append(make_request(f"r{self.num_added}", tokens))
        self.num_added += 1

    def _allocate(self, request: Request, num_new: int, num_draft: int, hit_blocks: list[int]) -> bool:
        """Allocate, assert all-or-nothing, and write the computed tokens into the shadow blocks."""
        kv = self.kv
        before = copy.deepcopy({k: v for k, v in kv.__dict__.items() if k != "_req_hashes"})
        table_before = list(kv.get_block_ids(request.request_id))
        new = kv.allocate_slots(request, num_new + num_draft, hit_blocks)
        if new is None:
            after = {k: v for k, v in kv.__dict__.items() if k != "_req_hashes"}
            assert after == before, "a failed allocate_slots changed the pool"
            return False
        table = kv.get_block_ids(request.request_id)
        assert table == table_before + hit_blocks + new
        start = request.num_computed_tokens + len(hit_blocks) * kv.block_size
        for pos in range(start, start + num_new + num_draft):
            block = table[pos // kv.block_size]
            assert kv._ref_cnt[block] == 1, f"writing position {pos} into shared block {block}"
            token = request.all_token_ids[pos] if pos < start + num_new else -1  # drafts: garbage
            self.content[block][pos % kv.block_size] = token
        request.num_computed_tokens = start + num_new
        return True

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        blocks, hit = self.kv.get_computed_blocks(request)
        bs = self.kv.block_size
        assert hit == len(blocks) * bs and 0 <= hit <= request.num_tokens - 1
        for i, block in enumerate(blocks):
            assert self.content[block] == request.all_token_ids[i * bs:(i + 1) * bs], "stale prefix hit"
        num_new = data.draw(st.integers(1, request.num_tokens - hit))
        if self._allocate(request, num_new, 0, blocks):
            self.waiting.remove(request)
            self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:  # decode: sample one token
            request.append_output_token(data.draw(st.integers(0, 1)))
        remaining = request.num_tokens - request.num_computed_tokens
        num_new = data.draw(st.integers(1, remaining))
        num_draft = data.draw(st.integers(0, 2)) if num_new == remaining else 0
        if not self._allocate(request, num_new, num_draft, []):  # preempt by recompute
            self.kv.free(request)
            request.num_computed_tokens = 0
            self.running.remove(request)
            self.waiting.append(request)

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running + self.waiting))
        self.kv.free(request)
        (self.running if request in self.running else self.waiting).remove(request)

    @invariant()
    def pool_is_consistent(self) -> None:
        kv = self.kv
        if kv is None:
            return
        kv.check_invariants()
        owners = [0] * kv.num_blocks
        for request in self.running:
            table = kv.get_block_ids(request.request_id)
            assert len(set(table)) == len(table)
            assert len(table) * kv.block_size >= request.num_computed_tokens
            for block in table:
                owners[block] += 1
        assert all(kv.get_block_ids(r.request_id) == [] for r in self.waiting)
        assert owners == kv._ref_cnt
        assert 0 <= kv.num_free_blocks <= kv.num_blocks
        assert kv.num_free_blocks == kv.num_blocks - sum(1 for n in owners if n)

    def teardown(self) -> None:
        if self.kv is None:
            return
        for request in self.running + self.waiting:
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        self.kv.check_invariants()


PagedAllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedAllocatorMachine = PagedAllocatorMachine.TestCase


def test_can_allocate_agrees_and_lookups_count_once_per_admission() -> None:
    kv = PagedKVAllocator(num_blocks=5, block_size=4)
    admit(kv, make_request("r1", range(8)))  # 2 blocks, both cached
    hog = make_request("hog", [3])
    kv.allocate_slots(hog, 1)  # 2 blocks left free
    r2 = make_request("r2", [*range(8), 1, 2, 3, 4, 5, 6, 7, 8, 9])
    for _ in range(3):  # retried lookups (e.g. the scheduler waiting for space) change no counter
        blocks, hit = kv.get_computed_blocks(r2)
    assert kv.stats().prefix_queries_tokens == 8 + 1  # r1 and hog admissions only
    assert not kv.can_allocate(r2, r2.num_tokens - hit, blocks)
    assert kv.allocate_slots(r2, r2.num_tokens - hit, blocks) is None
    kv.free(hog)  # r2 needs 3 new blocks; its 2 hit blocks are shared with r1
    assert kv.can_allocate(r2, r2.num_tokens - hit, blocks)
    assert kv.allocate_slots(r2, r2.num_tokens - hit, blocks) is not None
    assert (kv.stats().prefix_queries_tokens, kv.stats().prefix_hits_tokens) == (8 + 1 + 17, 8)
    kv.check_invariants()
