"""The in-place paged attention kernel of ``torch_paged`` and its KV-cache layout.

Layout ``HDN``. One layer's cache is ``(2, num_blocks, kv_heads, block_size * head_size)`` (block id
on dim 1, as for every backend; :func:`cache_shape`): each block is stored head-major, and within a
head the key block is ``[head_size, block_size]`` and the value block ``[block_size, head_size]``
(:func:`key_blocks`, :func:`value_blocks` view them as ``[num_blocks, kv_heads, ...]``). With the
block's positions innermost, the score loop ``q . K`` that inductor generates runs over
``head_size`` as plain multiply-adds on a vector of ``block_size`` keys (vLLM's CUDA key cache splits
the head dimension in front of the block positions for the same reason), instead of one horizontal
dot product per (token, key, head): 0.64x the kernel time of the per-slot formulation at batch 64 on
the 2-core CPU (SmolLM2 shapes, caches streamed from DRAM). The weighted sum over values keeps
``head_size`` innermost; head-major value blocks make one KV head's values a contiguous
``block_size * head_size`` run.

The last dim is one flat ``block_size * head_size`` run so that every element's index is
division-free: key ``(h, d)`` of slot offset ``o`` is at ``[0, block, h, d * block_size + o]``, the
value at ``[1, block, h, o * head_size + d]``. A compiled graph writes the step's K/V with one
``index_put_`` on the cache tensor itself (:func:`write_kv_in_graph`), which inductor performs in
place inside its generated loop; in a shape that split those offsets over two dims, the index math
needed integer divisions per element.

The kernel (:func:`paged_attention`) is plain torch: ``torch.compile`` turns the block-table lookup
into indirect loads inside its generated loops (Kwon et al., SOSP'23, Sec. 4.1: no per-request copy
of the context), and it is traceable into a larger graph (the compiled decoder of
``engine.compile``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

#: Blocks per KV partition (:func:`kv_partitions`): a token's keys are cut into partitions of
#: ``PARTITION_BLOCKS * block_size`` keys, and a partition's blocks are separate reductions of one
#: generated loop, so ``PARTITION_BLOCKS`` independent streams of K/V are in flight.
PARTITION_BLOCKS = 4
#: Least partitions of a step, and least partitions per token (the width of ``KVPartitions.partitions``):
#: dynamo specialises dims of size 0 and 1, so a short context would otherwise compile a graph of its own.
MIN_PARTITIONS = 2


@dataclass
class KVPartitions:
    """A run of tokens' keys cut into partitions of ``PARTITION_BLOCKS`` blocks (:func:`kv_partitions`).

    ``V`` partitions in all, ``T`` tokens, at most ``C`` partitions per token. Built once per step,
    shared by all layers.
    """

    block_tables: torch.Tensor  # (V, PARTITION_BLOCKS) int64 block ids of each partition (past the table: its last column)
    kv_lens: torch.Tensor  # (V,) int64 keys of the partition its token sees, counted from its first key (>= 1)
    tokens: torch.Tensor  # (V,) int64 the query row of each partition
    partitions: torch.Tensor  # (T, C) int64 each token's partitions (ids into V), padded with its first one
    num_partitions: torch.Tensor  # (T,) int64 valid entries of each ``partitions`` row (>= 1)
    kv_starts: torch.Tensor | None = None  # (V,) int64 leading keys of the partition outside its token's
    # sliding window (masked; non-zero only in a token's first partition); None: no window


def kv_partitions(block_table: torch.Tensor, kv_lens: Sequence[int] | np.ndarray, block_size: int,
                  rows: Sequence[int] | np.ndarray | None = None, window: int | None = None) -> KVPartitions:
    """Cut each token's visible keys into partitions of ``PARTITION_BLOCKS`` blocks.

    Token ``t`` sees keys ``0 .. kv_lens[t] - 1`` of its request (with a sliding ``window`` W only the
    last ``W`` of them: positions > its own - W), so it has ``ceil(keys / (PARTITION_BLOCKS *
    block_size))`` partitions counted from the block of its first visible key; partition ``i`` covers
    its request's table columns ``first_block + i * PARTITION_BLOCKS ..`` (columns past the table read
    its last column: masked keys). Blocks wholly before a token's window are never read (the KV-memory
    manager may reuse them). The work of :func:`paged_attention` is then the keys each token needs,
    rounded up to a partition, instead of every token padded to the longest context of the step
    (vLLM's PagedAttention V2 partitions contexts the same way; flash-decoding, Dao et al. 2023).
    Fewer than :data:`MIN_PARTITIONS` partitions are padded with dummy ones (the first partition's
    blocks, one key, token 0) that no token reads. The index arithmetic runs on the host (numpy,
    ~53 us for 64 tokens here); the device does one gather of the block ids.

    Args:
        block_table: ``(R, NB)`` int block ids of each request (any ids past its blocks).
        kv_lens: ``(T,)`` host ints, keys up to and including each token (its position + 1), each >= 1.
        block_size: tokens per block.
        rows: ``(T,)`` host ints, each token's row of ``block_table`` (default: token ``t`` is row ``t``).
        window: sliding window W in tokens, or ``None`` (every key up to the token's own).

    Returns:
        :class:`KVPartitions` on ``block_table``'s device, every tensor contiguous int64
        (``kv_starts`` only with a ``window``).

    Raises:
        ValueError: a token sees more keys than its table's blocks hold.
    """
    lens = np.asarray(kv_lens, dtype=np.int64)
    num_tokens = len(lens)
    rows = np.arange(num_tokens) if rows is None else np.asarray(rows, dtype=np.int64)
    if -(-int(lens.max()) // block_size) > block_table.shape[1]:
        raise ValueError(f"a token sees {int(lens.max())} keys, more than the table's "
                         f"{block_table.shape[1]} blocks of {block_size} hold")
    first_block = np.zeros_like(lens) if window is None else np.maximum(lens - window, 0) // block_size  # (T,)
    span = PARTITION_BLOCKS * block_size
    keys = lens - first_block * block_size  # (T,) counted from the first block read
    counts = -(-keys // span)  # (T,)
    tokens = np.repeat(np.arange(num_tokens), counts)  # (V,)
    first = np.cumsum(counts) - counts  # (T,) each token's first partition
    index = np.arange(len(tokens)) - first[tokens]  # (V,) partition i of its token
    part_lens = keys[tokens] - index * span
    starts = None
    if window is not None:  # keys of the first block before the window
        starts = np.where(index == 0, np.maximum(lens - window, 0)[tokens] - first_block[tokens] * block_size, 0)
    width = max(int(counts.max()), MIN_PARTITIONS)  # C
    partitions = first[:, None] + np.minimum(np.arange(width), counts[:, None] - 1)
    if len(tokens) < MIN_PARTITIONS:
        pad = MIN_PARTITIONS - len(tokens)
        tokens, index = np.pad(tokens, (0, pad)), np.pad(index, (0, pad))
        part_lens = np.pad(part_lens, (0, pad), constant_values=1)
        starts = None if starts is None else np.pad(starts, (0, pad))
    columns = np.minimum(first_block[tokens][:, None] + index[:, None] * PARTITION_BLOCKS
                         + np.arange(PARTITION_BLOCKS), block_table.shape[1] - 1)
    device = block_table.device

    def put(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    block_tables = block_table[put(rows[tokens])[:, None], put(columns)].long()  # (V, P)
    return KVPartitions(block_tables, put(part_lens), put(tokens), put(partitions), put(counts),
                        None if starts is None else put(starts))


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_size: int) -> tuple[int, ...]:
    """One layer's ``HDN`` cache shape: ``(2, num_blocks, kv_heads, block_size * head_size)``."""
    return (2, num_blocks, kv_heads, block_size * head_size)


def key_blocks(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """The key cache as ``[num_blocks, kv_heads, head_size, block_size]`` (a view, no copy).

    Args:
        kv_cache: one layer's :func:`cache_shape` cache.
        head_size: elements per head.
    """
    num_blocks, kv_heads, run = kv_cache.shape[1:]
    return kv_cache[0].view(num_blocks, kv_heads, head_size, run // head_size)


def value_blocks(kv_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """The value cache as ``[num_blocks, kv_heads, block_size, head_size]`` (a view, no copy).

    Args:
        kv_cache: one layer's :func:`cache_shape` cache.
        head_size: elements per head.
    """
    num_blocks, kv_heads, run = kv_cache.shape[1:]
    return kv_cache[1].view(num_blocks, kv_heads, run // head_size, head_size)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V at ``slot_mapping`` in the layout above (mutates ``kv_cache``), eagerly.

    Args:
        kv_cache: :func:`cache_shape`.
        key, value: ``(num_tokens, kv_heads, head_size)``, any float dtype (cast to the cache's).
        slot_mapping: ``(num_tokens,)`` int64, slot = block_id * block_size + offset.
    """
    head_size = key.shape[-1]
    block_size = kv_cache.shape[-1] // head_size
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    key_blocks(kv_cache, head_size)[block, :, :, offset] = key.to(kv_cache.dtype)  # advanced dims first: [T, KVH, D]
    value_blocks(kv_cache, head_size)[block, :, offset] = value.to(kv_cache.dtype)


def write_kv_in_graph(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv` for a compiled graph: the same stores, as ``index_put_`` on ``kv_cache`` itself.

    The mutation targets the graph input, not a view of it, so inductor writes in place inside its
    generated loop. :func:`write_kv`'s stores through views made inductor copy the whole cache per
    layer (functionalization turns a mutation through a view into a scatter of the base), and the
    opaque custom op it was wrapped in before cost ~80 us of Python dispatch per layer and step at
    batch 1. Eagerly this is slower than :func:`write_kv` (4 index tensors), hence the two
    formulations; ``tests/plugins/attention/test_torch_paged.py`` checks they store the same.

    Args:
        kv_cache: :func:`cache_shape`, mutated.
        key, value: ``(num_tokens, kv_heads, head_size)``, any float dtype (cast to the cache's).
        slot_mapping: ``(num_tokens,)`` int64, slot = block_id * block_size + offset.
    """
    kv_heads, head_size = key.shape[1:]
    block_size = kv_cache.shape[-1] // head_size
    block = (slot_mapping // block_size).view(-1, 1, 1)
    offset = (slot_mapping % block_size).view(-1, 1, 1)
    head = torch.arange(kv_heads, device=slot_mapping.device).view(1, -1, 1)
    dim = torch.arange(head_size, device=slot_mapping.device).view(1, 1, -1)
    kv_cache.index_put_((torch.zeros_like(block), block, head, dim * block_size + offset), key.to(kv_cache.dtype))
    kv_cache.index_put_((torch.ones_like(block), block, head, offset * head_size + dim), value.to(kv_cache.dtype))


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V stored at ``slots``: two ``(len(slots), kv_heads, head_size)`` tensors (copies)."""
    block_size = kv_cache.shape[-1] // head_size
    block, offset = slots // block_size, slots % block_size
    return key_blocks(kv_cache, head_size)[block, :, :, offset], value_blocks(kv_cache, head_size)[block, :, offset]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, kv: KVPartitions, scale: float,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each token attends over the first ``kv_lens[t]`` keys of its request (the last W of them with a
    sliding window: ``kv`` built with ``window``), read in place.

    Decode rows and prefill chunks alike (a chunk token's visible keys are its position + 1, which
    makes it causal). Computed in float32, in two phases:

    1. Each partition (:func:`kv_partitions`) computes its softmax max ``m``, sum ``l`` and
       unnormalised value sum ``o`` over its keys (one work item of ``PARTITION_BLOCKS`` blocks:
       padding is at most one partition per token, not every token padded to the step's longest).
    2. Each token combines its partitions: ``out = sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) l_i``
       with ``M = max_i m_i`` (the flash-decoding reduction; Dao et al. 2023; vLLM's PagedAttention
       V2 reduce kernel). A sink logit ``s`` (gpt-oss) joins the denominator only:
       ``M = max(M, s)`` and ``+ e^(s - M)``.

    A softcap ``c`` (Gemma 2) bends each score to ``c * tanh(score / c)`` after scaling, before the
    mask, as transformers' eager attention does.

    The loops inductor generates for phase 1 are shaped by how it is written:

    - GQA: each of a KV head's ``G = H / KVH`` query heads is its own reduction over the same K/V
      loads, so inductor fuses them into one loop with ``G`` accumulators: each K/V block is loaded
      once per KV head (not ``G`` times), and the ``G`` independent add chains hide the FMA latency.
    - A partition's ``PARTITION_BLOCKS`` blocks are separate reductions too, fused into the same
      loop, so that many randomly placed blocks stream in at once (memory-level parallelism instead
      of one block's miss latency at a time).
    - Softmax max, sum and the value sum combine the blocks elementwise inside one reduction each.

    In the compiled engine on the 2-core CPU (SmolLM2 bf16, mixed-length workload, 64 requests),
    the kernel took 595 / 584 / 560 us per layer at decode steps 10 / 40 / 120, against 873 / 728 /
    626 us when every token was padded to the step's longest context; with equal contexts (the
    64 x 128 workload) the two do the same work (688 vs 728 us, noise).

    Args:
        query: ``[T, KVH, G, D]``, any float dtype.
        kv_cache: the layer's cache in this module's layout.
        kv: the tokens' :class:`KVPartitions` (``kv_partitions``).
        scale: softmax scale.
        softcap: attention-logit softcap, or ``None``.
        sinks: ``(KVH * G,)`` per-head sink logits, or ``None``.

    Returns:
        ``[T, KVH, G, D]`` in ``query.dtype``.
    """
    group, head_size = query.shape[2], query.shape[3]
    block_size = kv_cache.shape[-1] // head_size
    q = query.float() * scale
    # a no-op view that inductor lowers only on a realised input: traced into a larger graph, the
    # scaled queries become a buffer, where otherwise their producers (RoPE's cos/sin) are inlined
    # into the score loop and recomputed for every block of keys (a 154 instead of 99 ms step)
    q = q.as_strided(q.shape, q.stride())[kv.tokens]  # [V, KVH, G, D]
    pos = torch.arange(block_size, device=query.device)
    columns = range(kv.block_tables.shape[1])
    keys = [key_blocks(kv_cache, head_size)[kv.block_tables[:, b]].float() for b in columns]  # [V, KVH, D, BS]
    values = [value_blocks(kv_cache, head_size)[kv.block_tables[:, b]].float() for b in columns]  # [V, KVH, BS, D]
    tops, totals, sums = [], [], []
    for g in range(group):
        scores = [(q[:, :, g, :, None] * keys[b]).sum(-2) for b in columns]  # [V, KVH, BS]
        if softcap is not None:
            scores = [torch.tanh(s / softcap) * softcap for s in scores]
        scores = [s.masked_fill(_masked(pos + b * block_size, kv), float("-inf")) for b, s in zip(columns, scores)]
        top = functools.reduce(torch.maximum, scores).amax(-1, keepdim=True)  # [V, KVH, 1]
        weights = [(s - top).exp() for s in scores]
        tops.append(top)
        totals.append(sum(weights).sum(-1, keepdim=True))
        # one reduction over a block's positions of the blocks' summed products: P value streams in one loop
        sums.append(sum(w[..., None] * v for w, v in zip(weights, values)).sum(2))  # [V, KVH, D]
    top, total, acc = torch.stack(tops, 2), torch.stack(totals, 2), torch.stack(sums, 2)  # [V, KVH, G, 1 | 1 | D]
    valid = torch.arange(kv.partitions.shape[1], device=query.device) < kv.num_partitions[:, None]  # [T, C]
    part_top = top[kv.partitions].masked_fill(~valid[:, :, None, None, None], float("-inf"))  # [T, C, KVH, G, 1]
    top_all = part_top.amax(1, keepdim=True)  # [T, 1, KVH, G, 1]
    if sinks is not None:
        sink = sinks.float().view(1, 1, *query.shape[1:3], 1)
        top_all = torch.maximum(top_all, sink)
    rescale = (part_top - top_all).exp()
    denominator = (rescale * total[kv.partitions]).sum(1)  # [T, KVH, G, 1]
    if sinks is not None:
        denominator = denominator + (sink - top_all).exp()[:, 0]
    out = (rescale * acc[kv.partitions]).sum(1) / denominator  # [T, KVH, G, D]
    return out.to(query.dtype)


def _masked(key_pos: torch.Tensor, kv: KVPartitions) -> torch.Tensor:
    """``[V, 1, BS]`` True for a partition's keys its token does not see (``key_pos``: ``(BS,)`` offsets
    from the partition's first key): at or past ``kv_lens``, or before ``kv_starts`` (sliding window)."""
    masked = key_pos >= kv.kv_lens[:, None, None]
    if kv.kv_starts is not None:
        masked = masked | (key_pos < kv.kv_starts[:, None, None])
    return masked
