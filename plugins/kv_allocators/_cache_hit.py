"""Longest prefix-cache hit over several KV cache groups (vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``
and the per-type rules of ``single_type_kv_cache_manager.py``).

A hit of ``h`` blocks lets a request start computing at token ``h * block_size``. A full-attention group
needs every block before it; a sliding group (window W) only the ``ceil((W - 1) / block_size)`` blocks
right before it (the keys its first computed query sees), its earlier entries being the null block. The
groups' answers are reconciled by a fixed point: each group in turn shortens the candidate length to
the longest hit it can serve at most that long, until a whole pass changes nothing (full groups first:
their hits are prefix-closed, so they bound the others cheaply).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from framework.interfaces import KVCacheGroup

#: ``lookup(group_index, block_index) -> block id`` of the cached block with that content, or ``None``.
Lookup = Callable[[int, int], "int | None"]


def group_hit(group: int, spec: KVCacheGroup, lookup: Lookup, max_blocks: int, block_size: int,
              null_block: int) -> list[int]:
    """The longest hit of one group of at most ``max_blocks`` blocks: its block ids, the null block where
    the group needs nothing.

    Full attention: the cached run from block 0. Sliding window: scanning from the right, the first run
    of ``spec.num_hit_window_blocks`` cached blocks ends the hit (earlier entries null); with no such run,
    the cached run from block 0 (shorter than the window: every block before the hit point is there).
    """
    need = spec.num_hit_window_blocks(block_size)
    if need is None:
        blocks = []
        for i in range(max_blocks):
            block = lookup(group, i)
            if block is None:
                break
            blocks.append(block)
        return blocks
    if need == 0:  # W == 1: a query sees only itself
        return [null_block] * max_blocks
    run: list[int] = []  # cached blocks ending at the scan position, right to left
    for i in range(max_blocks - 1, -1, -1):
        block = lookup(group, i)
        if block is None:
            run = []
            continue
        run.append(block)
        if len(run) == need:
            return [null_block] * i + run[::-1]
    return run[::-1]  # the run from block 0 (empty when block 0 is not cached)


def longest_cache_hit(groups: Sequence[KVCacheGroup], lookup: Lookup, max_blocks: int, block_size: int,
                      null_block: int) -> list[list[int]]:
    """Each group's hit blocks at the longest hit length every group can serve (equal lengths).

    Args:
        groups: the allocator's KV cache groups.
        lookup: cached block of ``(group, block index)`` for the request's content, or ``None``.
        max_blocks: upper bound on the hit, blocks (leaves one token to compute).
        block_size: tokens per block.
        null_block: id of released entries.

    Returns:
        One list per group, all of the same length (possibly 0).
    """
    order = sorted(range(len(groups)), key=lambda g: groups[g].sliding_window is not None)
    hits: list[list[int]] = [[] for _ in groups]
    num = max_blocks
    while True:
        before = num
        for g in order:
            hits[g] = group_hit(g, groups[g], lookup, num, block_size, null_block)
            num = len(hits[g])
        if num == before:
            return hits
