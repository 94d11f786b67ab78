"""RadixAttention allocator: match/insert with edge splits, lock counts, leaf-first LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from plugins.kv_allocators.radix import RadixKVAllocator


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams())


def compute(kv: RadixKVAllocator, request: Request, num_new: int | None = None) -> list[int] | None:
    """Scheduler-style: lookup, allocate, then mark the tokens computed (the forward ran)."""
    blocks, hit = kv.get_computed_blocks(request) if request.request_id not in kv._tables else ([], 0)
    num_new = request.num_tokens - request.num_computed_tokens - hit if num_new is None else num_new
    new = kv.allocate_slots(request, num_new, blocks)
    if new is not None:
        request.num_computed_tokens += hit + num_new
    return new


def test_written_blocks_are_shared_through_the_tree_and_split_edges() -> None:
    kv = RadixKVAllocator(num_blocks=16, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    compute(kv, a)
    kv.free(a)  # inserts the 3 full written blocks as one edge
    assert kv.get_computed_blocks(make_request("x", [1, 2, 3, 4, 5, 6, 9]))[1] == 6
    b = make_request("b", [1, 2, 3, 4, 8, 8, 8])  # shares 2 blocks: the edge splits after 2
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 4 and len(blocks) == 2
    compute(kv, b)
    assert kv.get_block_ids("b")[:2] == blocks
    kv.check_invariants()
    root_child = next(iter(kv._root.children.values()))
    assert len(root_child.blocks) == 2 and len(root_child.children) == 1  # split at the block boundary
    kv.free(b)
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_locked_paths_are_never_evicted_and_lru_leaf_goes_first() -> None:
    kv = RadixKVAllocator(num_blocks=6, block_size=2)
    old, new = make_request("old", [1, 1, 2, 2, 0]), make_request("new", [3, 3, 4, 4, 0])
    for r in (old, new):
        compute(kv, r)
        kv.free(r)  # each leaves 2 cached blocks; old's are less recently used
    holder = make_request("holder", [3, 3, 4, 4, 9])
    compute(kv, holder)  # locks new's path
    hog = make_request("hog", list(range(10, 14)))
    assert compute(kv, hog) is not None  # needs 2 blocks: 1 free + evicts from old's (unlocked) leaf
    assert kv.get_computed_blocks(make_request("q", [3, 3, 4, 4, 7]))[1] == 4  # locked path intact
    assert kv.get_computed_blocks(make_request("p", [1, 1, 2, 2, 7]))[1] < 4  # old's tail evicted
    kv.check_invariants()
    assert not kv.can_allocate(make_request("big", list(range(20, 30))), 10)


def test_prefix_caching_off_keeps_everything_private() -> None:
    kv = RadixKVAllocator(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    assert not kv._root.children


def test_bad_sizes() -> None:
    with pytest.raises(ValueError):
        RadixKVAllocator(num_blocks=0, block_size=2)


class RadixMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), chunked steps, decodes, preemptions and finishes;
    the allocator's own invariant check runs after every rule (blocks owned exactly once, lock
    counts = locks in each subtree, evictable count, tables only use locked tree blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: RadixKVAllocator | None = None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.n = 0

    @initialize(num_blocks=st.integers(2, 12), block_size=st.integers(1, 3), caching=st.booleans())
    def init(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.kv = RadixKVAllocator(num_blocks, block_size, enable_prefix_caching=caching)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=10))
    def add(self, tokens: list[int]) -> None:
        self.waiting.append(make_request(f"r{self.n}", tokens))
        self.n += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.waiting))
        blocks, hit = self.kv.get_computed_blocks(request)
        num_new = data.draw(st.integers(1, request.num_tokens - hit))
        if self.kv.allocate_slots(request, num_new, blocks) is not None:
            request.num_computed_tokens = hit + num_new
            self.waiting.remove(request)
            self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(data.draw(st.integers(0, 1)))
        num_new = data.draw(st.integers(1, request.num_tokens - request.num_computed_tokens))
        if self.kv.allocate_slots(request, num_new) is None:
            self.kv.free(request)  # preempt (recompute)
            request.num_computed_tokens = 0
            self.running.remove(request)
            self.waiting.append(request)
        else:
            request.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(self.running))
        self.kv.free(request)
        self.running.remove(request)

    @invariant()
    def consistent(self) -> None:
        if self.kv is not None:
            self.kv.check_invariants()
            assert 0 <= self.kv.num_free_blocks <= self.kv.num_blocks

    def teardown(self) -> None:
        if self.kv is None:
            return
        for request in self.running:
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        self.kv.check_invariants()


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixMachine = RadixMachine.TestCase
