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

import torch

#: Parts each token's block table is split into (:func:`paged_attention`): the parts' blocks are
#: read in the same generated loop, so ``KV_SPLITS`` independent streams of K/V are in flight.
KV_SPLITS = 4


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


def split_block_table(table: torch.Tensor, min_columns: int) -> torch.Tensor:
    """A ``[rows, NB]`` block table as :func:`paged_attention`'s ``[rows, KV_SPLITS, NBp]`` parts.

    Columns are padded with block 0 (past every row's length, so masked) to ``KV_SPLITS * NBp``
    with ``NBp >= min_columns`` (a dynamic dim of size 0 or 1 would specialise a compiled graph).
    Part ``p`` holds logical blocks ``p * NBp .. (p + 1) * NBp - 1``.

    Args:
        table: ``[rows, NB]`` int block ids.
        min_columns: least ``NBp`` (``torch_paged.MIN_TABLE_COLUMNS``).

    Returns:
        ``[rows, KV_SPLITS, NBp]`` int64, contiguous.
    """
    per_part = max(-(-table.shape[1] // KV_SPLITS), min_columns)
    pad = KV_SPLITS * per_part - table.shape[1]
    table = torch.nn.functional.pad(table.long(), (0, pad))
    return table.view(table.shape[0], KV_SPLITS, per_part).contiguous()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each token attends over the first ``kv_lens[t]`` keys of its request, read in place.

    Decode rows and prefill chunks alike (a chunk token's ``kv_lens`` is its position + 1, which
    makes it causal). Computed in float32 with a two-pass softmax over the visible keys.

    The loops inductor generates are shaped by how this is written:

    - GQA: each of a KV head's ``G = H / KVH`` query heads is its own reduction over the same K/V
      loads, so inductor fuses them into one loop with ``G`` accumulators: each K/V block is loaded
      once per KV head (not ``G`` times), and the ``G`` independent add chains hide the FMA latency.
    - The block table comes split in ``P`` parts (:func:`split_block_table`); the parts are
      separate reductions too, fused into the same loop, so ``P`` randomly placed blocks stream in at
      once (memory-level parallelism instead of one block's miss latency at a time). On the 2-core
      CPU, batch 64, contexts 120-180 (SmolLM2 shapes, caches streamed from DRAM): 1.07-1.15 ms per
      layer with one part and one reduction for the group, 0.68-0.81 with ``G x 4``.
    - Softmax max, sum and the value sum combine the parts elementwise inside one reduction each (no
      concatenated score buffer, and no per-part maxima: each is a buffer the compiled wrapper allocates).

    Args:
        query: ``[T, KVH, G, D]``, any float dtype.
        kv_cache: the layer's cache in this module's layout.
        block_tables: ``[T, P, NBp]`` int64 (:func:`split_block_table`), each token's request's
            block table, padded with any valid block id; ``P * NBp * block_size >= max(kv_lens)``.
        kv_lens: ``[T]`` int64 keys visible to each token, each >= 1.
        scale: softmax scale.

    Returns:
        ``[T, KVH, G, D]`` in ``query.dtype``.
    """
    num_parts, group = block_tables.shape[1], query.shape[2]
    q = query.float() * scale
    # a no-op view that inductor lowers only on a realised input: traced into a larger graph, the
    # scaled queries become a buffer, where otherwise their producers (RoPE's cos/sin) are inlined
    # into the score loop and recomputed for every block of keys (a 154 instead of 99 ms step)
    q = q.as_strided(q.shape, q.stride())
    head_size = query.shape[-1]
    part_len = block_tables.shape[2] * (kv_cache.shape[-1] // head_size)  # keys per part
    pos = torch.arange(part_len, device=query.device)
    keys = [key_blocks(kv_cache, head_size)[block_tables[:, p]].permute(0, 2, 1, 3, 4).float()  # [T, KVH, NBp, D, BS]
            for p in range(num_parts)]
    values = [value_blocks(kv_cache, head_size)[block_tables[:, p]].permute(0, 2, 1, 3, 4).flatten(2, 3).float()
              for p in range(num_parts)]  # [T, KVH, NBp * BS, D]
    out = []
    for g in range(group):
        scores = [(q[:, :, g, None, :, None] * keys[p]).sum(-2).flatten(2).masked_fill(  # [T, KVH, NBp * BS]
            pos + p * part_len >= kv_lens[:, None, None], float("-inf")) for p in range(num_parts)]
        # the parts combined elementwise inside one reduction each (fewer buffers than per-part maxima)
        top = functools.reduce(torch.maximum, scores).amax(-1, keepdim=True)  # [T, KVH, 1]
        weights = [(s - top).exp() for s in scores]
        total = sum(weights).sum(-1, keepdim=True)
        # one reduction over a part's positions of the parts' summed products: P value streams in one loop
        out.append(sum(w[..., None] * v for w, v in zip(weights, values)).sum(2) / total)  # [T, KVH, D]
    return torch.stack(out, 2).to(query.dtype)
