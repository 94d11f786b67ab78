"""Reference paged attention in plain PyTorch (runs on CPU and GPU).

K/V are written into a paged cache through ``slot_mapping`` (Kwon et al., SOSP'23, Sec. 4.1);
each request attends over its blocks through ``block_table``. The flattened batch is split into
a decode segment (query length 1) and prefill segments (chunks, possibly with cached context, cut
into causal query tiles, :func:`query_tiles`, and bucketed by visible keys, :func:`length_buckets`),
each gathered per request into a padded batch and run through
``torch.nn.functional.scaled_dot_product_attention`` with a mask built once per step (and once per
sliding window: keys at positions > q - W). Layers with a softcap or sinks, which SDPA lacks, run
the same gathered batch through explicit float32 math (``_attention_math.explicit_attention``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata
from plugins.attention import _paged_kernel
from plugins.attention._attention_math import LayerMath, explicit_attention
from plugins.attention._kv_quant import QMAX, SCALE_BYTES, dequantize_rows, quantize_rows


@dataclass
class _Segment:
    """Padded view of a group of requests; all tensors built once per step, masks once per window."""

    token_start: int  # first flattened token of the segment
    token_end: int  # one past its last token
    block_table: torch.Tensor  # (num_seg_reqs, num_blocks_needed) int64 block ids
    num_keys: int  # keys gathered per request: num_blocks_needed * block_size
    q_pos: torch.Tensor  # (num_seg_reqs, max_q) int64 position of each query row (decodes: max_q = 1)
    valid_q: torch.Tensor | None  # (num_seg_reqs, max_q) bool real query rows; None for decodes (all real)
    sdpa_group: int  # query rows per KV head in SDPA's packed prefill layout (G), else 1
    query_index: torch.Tensor | None  # (num_seg_reqs, max_q) int64 into the segment's tokens; None for decodes
    output_index: torch.Tensor | None  # (num_seg_tokens,) int64 into the flattened (reqs * max_q) outputs
    token_index: torch.Tensor | None = None  # (num_seg_tokens,) int64 step token of each output row; None: all of
    # token_start..token_end in order (a length bucket holds only some of the prefill requests)
    tree_allow: torch.Tensor | None = None  # (num_seg_reqs, max_q, num_keys) bool: draft-tree attention (see mask)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # see mask
    additive_masks: dict[tuple[torch.dtype, int | None], torch.Tensor] = field(default_factory=dict)  # see sdpa_mask

    def mask(self, window: int | None = None) -> torch.Tensor:
        """``(num_seg_reqs, max_q, num_keys)`` bool, True = attend: keys at positions ``<= q`` (and
        ``> q - window`` with a sliding window), and, for draft-tree requests, among their own query tokens only the
        ancestors (``tree_allow``); a padded query row attends to key 0 only (no all-masked, NaN rows). Built at the
        first layer with this window, reused by the others."""
        if window not in self.masks:
            kv_pos = torch.arange(self.num_keys, device=self.q_pos.device)[None, None, :]
            q_pos = self.q_pos[:, :, None]
            mask = kv_pos <= q_pos
            if window is not None:  # transformers: a query at position p sees keys at positions > p - W
                mask &= kv_pos > q_pos - window
            if self.tree_allow is not None:
                mask &= self.tree_allow
            if self.valid_q is not None:
                mask &= self.valid_q[:, :, None]
                mask[:, :, 0] |= ~self.valid_q
            self.masks[window] = mask
        return self.masks[window]

    def sdpa_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """:meth:`mask` as SDPA's additive float mask in ``dtype`` (0 = attend, -inf = masked), in SDPA's
        layout: ``[R, 1, G * max_q, S]`` (packed prefill, rows repeated per query head of a KV head) or
        ``[R, 1, max_q, S]``. Built at the first layer and reused by the others: SDPA converts a
        boolean mask on every call (a ``where`` over the whole mask per layer)."""
        key = (dtype, window)
        if key not in self.additive_masks:
            mask = self.mask(window)
            if self.sdpa_group > 1:
                num_reqs, max_q, num_keys = mask.shape
                mask = mask[:, None].expand(-1, self.sdpa_group, -1, -1).reshape(num_reqs, -1, num_keys)
            self.additive_masks[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device) \
                .masked_fill_(~mask, float("-inf"))[:, None]
        return self.additive_masks[key]


@dataclass
class TorchAttentionMetadata:
    """Per-step metadata of :class:`TorchAttentionBackend`."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slots of this step's tokens
    segments: list[_Segment]  # decode segment first (if any), then the prefill segment (if any)


#: Longest / shortest sequence within one padded prefill segment (see :func:`length_buckets`).
PREFILL_BUCKET_RATIO = 1.5


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with ``scaled_dot_product_attention`` over gathered blocks.

    KV cache per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)``. GQA never repeats
    K/V (prefill: ``enable_gqa``; decode: see ``decode_kernel``). Cost per layer: one ``index_copy_`` for the new K/V and one block gather
    per segment; padding is bounded by the longest sequence within each segment, and prefill requests
    are bucketed so that a segment's longest is at most 1.5x its shortest (mixed-length prefill
    steps: SDPA 0.62 -> ~0.2 s per 2048-token step on SmolLM2).

    Args (beyond ``AttentionBackend``'s):
        decode_kernel: how decodes handle GQA, an ablation switch
            (``attention.params.decode_kernel=...``): ``packed`` (default) runs SDPA with each KV
            head's query heads packed as query rows; ``gqa`` runs SDPA with one query row per head
            and ``enable_gqa=True`` (on CPU ~2x slower end to end; see docs/decisions/attention.md).
        prefill_kernel: the same choice for prefill chunks (``attention.params.prefill_kernel=...``):
            ``packed`` (default) runs SDPA on ``[R, KVH, G * max_q, D]`` queries, the causal mask
            repeated per query head (built once per step); ``gqa`` on ``[R, H, max_q, D]`` with
            ``enable_gqa=True``. Same arithmetic (the CPU flash kernel, float32 scores); packed gives
            the kernel ``G``x longer query blocks, 6.6-7.2 -> 5.4-6.6 ms per layer for 16 x 128
            SmolLM2 tokens in bf16 here.
        prefill_tile: query tokens per causal tile of a prefill chunk (default 64; ``0``: whole
            chunks), see :func:`query_tiles`. Tile ``j`` of a chunk sees only its ``(j + 1) * tile``
            keys instead of the chunk's all; mixed-workload prefill attention ~25% less time here.
        kv_layout: how blocks are stored: ``NHD`` (default, keys and values
            ``[block_size, kv_heads, head_size]``) or ``HDN`` (head-major: keys
            ``[kv_heads, head_size, block_size]``, values ``[kv_heads, block_size, head_size]``, in a
            ``(2, num_blocks, kv_heads, block_size * head_size)`` cache; the layout of ``torch_paged``, which
            attends through this backend for prefill chunks and small batches); unquantized only.

    KV-cache quantization (``engine.kv_cache_dtype=int8|fp8_e4m3``): the cache is
    ``(2, num_blocks, block_size, num_kv_heads, head_size + 4)`` int8, quantized values plus a
    float32 scale per (token, head) (see ``plugins/attention/_kv_quant.py``); K/V are dequantized to
    the query dtype after the block gather.

    Raises:
        ValueError: for an unknown ``decode_kernel``, ``prefill_kernel`` or ``kv_layout``, ``HDN`` with a
            quantized cache, or ``prefill_tile < 0``.
    """

    name = "torch"
    supported_kv_cache_dtypes = ("auto", "int8", "fp8_e4m3")
    supports_sliding_window = True  # through the mask (keys at positions > q - W)
    supports_softcap = True  # explicit math (_attention_math), SDPA has no softcap
    supports_sinks = True  # explicit math, the sink joins the softmax denominator
    supports_tree_attention = True  # the prefill segments' masks (tree_mask_rows)
    supports_latent_kv = True  # MLA: one cache tensor, V read as K (NHD only)
    DECODE_KERNELS = ("packed", "gqa")
    PREFILL_KERNELS = ("packed", "gqa")

    def __init__(self, *args: object, decode_kernel: str = "packed", prefill_kernel: str = "packed",
                 prefill_tile: int = 64, kv_layout: str = "NHD", **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if decode_kernel not in self.DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {self.DECODE_KERNELS}, got {decode_kernel!r}")
        if prefill_kernel not in self.PREFILL_KERNELS:
            raise ValueError(f"prefill_kernel must be one of {self.PREFILL_KERNELS}, got {prefill_kernel!r}")
        if int(prefill_tile) < 0:
            raise ValueError(f"prefill_tile must be >= 0 (0: whole chunks), got {prefill_tile}")
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.prefill_tile = int(prefill_tile)
        self.kv_quant = self.dtype if self.dtype in QMAX else None  # int8 / float8_e4m3fn or None
        if self.kv_quant is not None:
            self.cache_dtype = torch.int8
        if kv_layout not in ("NHD", "HDN") or (kv_layout == "HDN" and (self.kv_quant is not None or self.latent_kv)):
            raise ValueError(f"kv_layout must be NHD, or HDN with an unquantized, non-latent cache; got {kv_layout!r}")
        self.kv_cache_layout = kv_layout

    def get_kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, block_size, kv_heads, head_size)``; ``head_size + 4`` bytes when quantized;
        ``(2, num_blocks, kv_heads, block_size * head_size)`` in layout ``HDN``."""
        if self.kv_cache_layout == "HDN":
            return _paged_kernel.cache_shape(num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        extra = SCALE_BYTES if self.kv_quant is not None else 0
        return (1 if self.latent_kv else 2, num_blocks, self.block_size, self.num_kv_heads, self.head_size + extra)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        """Split into decode/prefill segments and build gather indices and masks (once per step)."""
        segments = []
        nd = common.num_decodes
        if nd:
            segments.append(self._decode_segment(common, nd))
        if nd < common.num_reqs:
            tiles = query_tiles(range(nd, common.num_reqs), common.query_lens_cpu, common.seq_lens_cpu,
                                self.prefill_tile)
            buckets = length_buckets(list(range(len(tiles))), [tile.kv_len for tile in tiles])
            in_order = len(buckets) == 1 and len(tiles) == common.num_reqs - nd
            segments += [self._prefill_segment(common, [tiles[i] for i in bucket], in_order) for bucket in buckets]
        return TorchAttentionMetadata(slot_mapping=common.slot_mapping, segments=segments)

    def _decode_segment(self, common: CommonAttentionMetadata, nd: int) -> _Segment:
        q_pos = common.seq_lens[:nd].long()[:, None] - 1
        num_blocks = -(-max(common.seq_lens_cpu[:nd]) // self.block_size)
        return _Segment(0, common.num_decode_tokens, common.block_table[:nd, :num_blocks].long(),
                        num_blocks * self.block_size, q_pos, None, 1, None, None)

    def _prefill_segment(self, common: CommonAttentionMetadata, tiles: list[QueryTile], in_order: bool) -> _Segment:
        """One padded segment of the query tiles ``tiles`` (``in_order``: one tile per prefill request, all
        of them, in batch order)."""
        device = common.seq_lens.device
        start = common.num_decode_tokens
        idx = torch.tensor([t.req for t in tiles], device=device)
        q_lens = torch.tensor([t.q_len for t in tiles], device=device)
        q_offs = torch.tensor([t.q_offset for t in tiles], device=device)
        q_starts = common.query_start_loc[idx].long() - start + q_offs
        ctx_lens = common.context_lens[idx].long() + q_offs  # position of each tile's first query
        max_q = max(t.q_len for t in tiles)
        num_blocks = -(-max(t.kv_len for t in tiles) // self.block_size)
        q_off = torch.arange(max_q, device=device)
        valid_q = q_off[None, :] < q_lens[:, None]  # (np, max_q)
        q_pos = ctx_lens[:, None] + q_off[None, :]  # absolute position of each query
        group = self.num_heads // self.num_kv_heads if self.prefill_kernel == "packed" else 1
        num_tokens = common.num_tokens - start
        query_index = torch.where(valid_q, q_starts[:, None] + q_off[None, :], 0).clamp_(max=num_tokens - 1)
        output_index = valid_q.flatten().nonzero().squeeze(1)
        token_index = None if in_order else (start + q_starts[:, None] + q_off[None, :])[valid_q]
        tree = None if common.spec_tree is None else tree_mask_rows(common, tiles, max_q, num_blocks * self.block_size)
        return _Segment(start, common.num_tokens, common.block_table[idx, :num_blocks].long(),
                        num_blocks * self.block_size, q_pos, valid_q, group, query_index, output_index, token_index,
                        tree)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchAttentionMetadata, **features: Any) -> torch.Tensor:
        """Write K/V at ``slot_mapping``, then attend per segment; see ``AttentionBackend.forward``."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        return self.attend(query, kv_cache, metadata, **features)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store K/V at ``slot_mapping`` (quantized when the cache is); see ``AttentionBackend.write_kv``."""
        if self.kv_cache_layout == "HDN":
            _paged_kernel.write_kv(kv_cache, key, value, slot_mapping)
            return
        flat_shape = (-1, self.num_kv_heads, kv_cache.shape[-1])
        if self.kv_quant is not None:
            key, value = quantize_rows(key, self.kv_quant), quantize_rows(value, self.kv_quant)
        kv_cache[0].view(flat_shape).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        if not self.latent_kv:  # a latent cache's V is its K's first channels
            kv_cache[1].view(flat_shape).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V stored at ``slots`` (dequantized to ``float32`` when the cache is quantized);
        see ``AttentionBackend.read_kv``."""
        if self.kv_cache_layout == "HDN":
            return _paged_kernel.read_kv(kv_cache, slots, self.head_size)
        key, value = (kv_cache[i].reshape(-1, self.num_kv_heads, kv_cache.shape[-1])[slots] for i in (0, -1))
        if self.kv_quant is not None:
            key = dequantize_rows(key, self.kv_quant, torch.float32)
            value = dequantize_rows(value, self.kv_quant, torch.float32)
        return key, value

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: TorchAttentionMetadata,
               scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention only (the step's K/V already in ``kv_cache``): ``query (T, H, D)`` -> ``(T, H, D)``,
        with the layer's features (``AttentionBackend.forward``).

        For backends that write the cache themselves and use this one for part of a step
        (``torch_paged``'s prefill chunks and small decode batches).
        """
        out = torch.empty_like(query)
        layer = LayerMath(self.scale if scale is None else scale, sliding_window, softcap, sinks)
        for seg in metadata.segments:
            result = self._attend(query[seg.token_start:seg.token_end], kv_cache, seg, layer)
            if seg.token_index is None:
                out[seg.token_start:seg.token_end] = result
            else:  # a length bucket: its tokens are scattered among the other buckets'
                out.index_copy_(0, seg.token_index, result)
        return out

    def _attend(self, query: torch.Tensor, kv_cache: torch.Tensor, seg: _Segment, layer: LayerMath) -> torch.Tensor:
        k, v = self._gather_kv(kv_cache, seg.block_table, query.dtype)
        decode = seg.query_index is None
        q = query if decode else query.index_select(0, seg.query_index.flatten()).view(*seg.query_index.shape,
                                                                                      *query.shape[1:])
        if layer.softcap is not None or layer.sinks is not None:  # SDPA has neither
            out = explicit_attention(q[:, None] if decode else q, k, v, seg.mask(layer.window), layer)
            return out[:, 0] if decode else out.flatten(0, 1).index_select(0, seg.output_index)
        mask = seg.sdpa_mask(query.dtype, layer.window)
        if decode:
            return self._decode_attend(q, k, v, mask, layer.scale)
        return self._prefill_attend(q, k, v, mask, layer.scale).index_select(0, seg.output_index)

    def _gather_kv(self, kv_cache: torch.Tensor, block_table: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of ``block_table`` (``[R, NB]`` int64) as K and V ``[R, kv_heads, NB * block_size, D]``
        in ``dtype`` (dequantized when the cache is quantized).

        Whole blocks are copied with ``index_select`` on the block dim, then laid out with one
        ``reshape``: 3.5x (HDN) and 2.7x (NHD) faster than advanced indexing with the 2-D table, which
        copies element-wise through the strided view (16 requests x 16 blocks, SmolLM2 heads, bf16).
        """
        num_reqs, blocks = block_table.shape
        flat = block_table.flatten()
        if self.kv_cache_layout == "HDN":  # per block: keys [KVH, D, BS], values [KVH, BS, D]
            k = _paged_kernel.key_blocks(kv_cache, self.head_size).index_select(0, flat)
            v = _paged_kernel.value_blocks(kv_cache, self.head_size).index_select(0, flat)
            k = k.view(num_reqs, blocks, *k.shape[1:]).permute(0, 2, 1, 4, 3)  # [R, KVH, NB, BS, D]
            v = v.view(num_reqs, blocks, *v.shape[1:]).transpose(1, 2)
            k, v = (x.reshape(num_reqs, self.num_kv_heads, -1, self.head_size) for x in (k, v))
            return k.to(dtype), v.to(dtype)
        # a latent cache (MLA) has one tensor, K = [c_kv, k_rope]: V is K itself (the bridge keeps c_kv's channels)
        kv = [x.index_select(0, flat).view(num_reqs, -1, self.num_kv_heads, x.shape[-1]) for x in kv_cache]
        k, v = kv[0], kv[-1]
        if self.kv_quant is not None:
            k, v = dequantize_rows(k, self.kv_quant, dtype), dequantize_rows(v, self.kv_quant, dtype)
        return k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype)

    def _prefill_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
        """Padded prefill chunks: ``q [R, max_q, H, D]``, ``k/v [R, KVH, S, D]``, ``mask`` as built for
        ``prefill_kernel`` (``[R, 1, G * max_q, S]`` packed, ``[R, 1, max_q, S]`` gqa) ->
        ``[R * max_q, H, D]`` (padding rows included)."""
        num_reqs, max_q = q.shape[:2]
        if self.prefill_kernel == "gqa":
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)  # [R, H, max_q, D]
            return o.transpose(1, 2).reshape(-1, self.num_heads, self.head_size)
        group = self.num_heads // self.num_kv_heads
        q = q.view(num_reqs, max_q, self.num_kv_heads, group, self.head_size).permute(0, 2, 3, 1, 4)
        o = F.scaled_dot_product_attention(q.reshape(num_reqs, self.num_kv_heads, group * max_q, self.head_size),
                                           k, v, attn_mask=mask, scale=scale)  # [R, KVH, G * max_q, D]
        o = o.view(num_reqs, self.num_kv_heads, group, max_q, self.head_size).permute(0, 3, 1, 2, 4)
        return o.reshape(-1, self.num_heads, self.head_size)

    def _decode_attend(self, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
        """One query token per request: ``query [R, H, D]``, ``k/v [R, KVH, S, D]``, ``mask [R, 1, 1, S]``.

        ``packed``: the ``G = H / KVH`` query heads of each KV head become ``G`` query rows
        (transformers' ``pack_gqa``), so SDPA needs neither ``enable_gqa`` nor a K/V repeat; on
        CPU the ``enable_gqa`` flash kernel costs ~0.1 ms per request and layer regardless of
        context length, which ``packed`` avoids.
        """
        num_reqs = query.shape[0]
        if self.decode_kernel == "gqa":
            o = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)  # [R, H, 1, D]
            return o[:, :, 0]
        group = self.num_heads // self.num_kv_heads
        q = query.reshape(num_reqs, self.num_kv_heads, group, self.head_size)  # [R, KVH, G, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o.reshape(num_reqs, self.num_heads, self.head_size)


@dataclass(frozen=True)
class QueryTile:
    """Query tokens ``q_offset .. q_offset + q_len - 1`` of prefill request ``req`` (offsets into its
    chunk), which see ``kv_len`` keys (its context, earlier tiles, and itself, causally)."""

    req: int
    q_offset: int
    q_len: int
    kv_len: int


def tree_mask_rows(common: CommonAttentionMetadata, tiles: list[QueryTile], max_q: int,
                   num_keys: int) -> torch.Tensor | None:
    """The draft-tree restriction of one padded prefill segment (``CommonAttentionMetadata.spec_tree``).

    Returns:
        ``(len(tiles), max_q, num_keys)`` bool on the metadata's device, True = allowed: everything but the keys of a
        tree request's own query chunk that are not an ancestor (or itself) of the query row; ``None`` when no tile
        belongs to a tree request.
    """
    trees = dict(zip(common.spec_tree.requests, common.spec_tree.visible, strict=True))
    if not any(t.req in trees for t in tiles):
        return None
    allow = torch.ones((len(tiles), max_q, num_keys), dtype=torch.bool)
    for i, tile in enumerate(tiles):
        visible = trees.get(tile.req)
        if visible is None:
            continue
        ctx = common.seq_lens_cpu[tile.req] - common.query_lens_cpu[tile.req]  # position of the chunk's first token
        width = min(visible.shape[1], num_keys - ctx)
        allow[i, :tile.q_len, ctx:ctx + width] = visible[tile.q_offset:tile.q_offset + tile.q_len, :width]
    return allow.to(common.seq_lens.device)


def query_tiles(reqs: Iterable[int], query_lens: list[int], seq_lens: list[int], tile: int) -> list[QueryTile]:
    """Split each request's query chunk into tiles of ``tile`` tokens (``0``: one tile per chunk).

    A causal chunk of ``L`` tokens attended as one ``[L, L]`` block computes the masked upper half
    too (the CPU flash kernel only skips key blocks of 512). Tile ``j`` of a chunk without context
    sees ``(j + 1) * tile`` keys, so the tiles of a chunk cost ``(n + 1) / (2 n)`` of the whole block
    with ``n = L / tile`` (FlashAttention's causal block skipping, Dao et al. 2022, Sec. 3.1, done
    per tile instead of inside the kernel).

    Args:
        reqs: prefill request indices.
        query_lens, seq_lens: per request of the step, query tokens and keys after the step.
        tile: query tokens per tile (>= 1), or 0 for whole chunks.

    Returns:
        The tiles in request order, each request's in query order.
    """
    tiles = []
    for r in reqs:
        q_len, ctx = query_lens[r], seq_lens[r] - query_lens[r]
        step = tile or q_len
        tiles += [QueryTile(r, off, min(step, q_len - off), ctx + min(off + step, q_len)) for off in range(0, q_len, step)]
    return tiles


def length_buckets(items: list[int], lengths: list[int], ratio: float = PREFILL_BUCKET_RATIO) -> list[list[int]]:
    """Group items (the step's query tiles) of similar key count, so that each padded segment wastes little.

    Items sorted by length (longest first) join the current bucket while ``ratio`` times their
    length reaches the bucket's longest; a bucket's padded ``[R, max_q, max_kv]`` SDPA then does at
    most ~``ratio`` x the work of its longest item per item.

    Args:
        items: indices into ``lengths``.
        lengths: keys each item attends to (for a query tile: its context plus itself).
        ratio: longest / shortest length allowed within a bucket (>= 1).

    Returns:
        Buckets of item indices (each in ``items`` order), longest bucket first; one bucket when
        lengths are within ``ratio``.
    """
    buckets: list[list[int]] = []
    for r in sorted(items, key=lambda r: -lengths[r]):
        if buckets and lengths[r] * ratio >= lengths[buckets[-1][0]]:
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return [sorted(bucket) for bucket in buckets]


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``torch``."""
    register("torch", TorchAttentionBackend)
