"""The unified paged-attention kernel of the ``triton`` backend, written in Triton alone.

One kernel serves a whole flattened batch, decode rows and prefill chunks alike (the kernel family
of vLLM's ``TRITON_ATTN`` backend, ``triton_unified_attention``): a program owns ``BLOCK_Q`` query
tokens of one request and one KV head, i.e. the ``BLOCK_M = BLOCK_Q * G`` query rows of those
tokens' ``G`` query heads that share the KV head (GQA: each K/V tile is loaded once for the group).
It walks its request's keys in tiles of ``TILE_SIZE`` positions, reading them in place through the
block table (PagedAttention, Kwon et al., SOSP'23, Sec. 4.1), and keeps a running softmax
(FlashAttention's online softmax, Dao et al., NeurIPS'22, Alg. 1) in float32. A sliding window
skips the tiles wholly before the window and masks the rest by position; a softcap bends each score
to ``c * tanh(s / c)`` (written ``c * (2 sigmoid(2 s / c) - 1)``, finite for any ``s``); a sink
logit starts the running max at the sink and the running sum at 1, so it joins the denominator only.

Which request a program serves is found in the kernel by a binary search over ``query_start_loc``
(request ``r``'s query blocks start at global index ``query_start_loc[r] // BLOCK_Q + r``), so the
grid ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)`` depends on shapes only and a decode step
of a fixed batch size launches the same grid every time: the launch can be captured in a CUDA graph.
Programs past their request's last query block return at once.

On CPU tensors the same kernel runs in Triton's interpreter (numpy), which Triton selects for every
``@triton.jit`` function, its own library's included, when ``TRITON_INTERPRET=1`` is set before
``triton`` is first imported (``tests/conftest.py`` sets it on machines without CUDA); the CPU tests
run this very code that way. :func:`interpreter_active` says whether it is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Key positions per inner-loop tile (a multiple of 16 for ``tl.dot``).
TILE_SIZE = 32


@triton.jit
def unified_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr,
    tree_rows_ptr, tree_mask_ptr, scale, softcap, num_seqs, stride_tree, tree_width,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_k_blk, stride_k_pos, stride_k_head, stride_v_blk, stride_v_pos, stride_v_head, stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_FLOAT32: tl.constexpr, USE_TREE: tl.constexpr,
):
    """One program: ``BLOCK_Q`` query tokens of one request x the query heads of one KV head (see the module).

    Longer than 60 lines on purpose: one GPU program reads best whole (find the request, load the
    queries, loop over key tiles, store), as vLLM's and FlashAttention's Triton kernels are written.
    """
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the request: the last r whose first query block (query_start_loc[r] // BLOCK_Q + r) is <= q_block
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)  # this program's query block within its request
    if local * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    offs_t = tl.arange(0, TILE)
    q_pos = local * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # (M,) query index within the request
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # (M,) query head
    # BLOCK_M may exceed BLOCK_Q * G (G = 3: 16 rows, 5 tokens): the spare rows belong to the next block
    row_ok = (offs_m // NUM_QUERIES_PER_KV < BLOCK_Q) & (q_pos < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_rows = (q_start + q_pos).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # (M, D)
    if DOT_FLOAT32:
        q = q.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    abs_pos = context_len + q_pos  # (M,) each row's position in its request
    if USE_SINKS:
        m_i = tl.load(sinks_ptr + head).to(tl.float32)  # the sink is the first "score" seen
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], tl.float32)
    if USE_TREE:  # first row of this request's tree mask, -1: causal (no tree this step)
        tree_row = tl.load(tree_rows_ptr + seq)
        tree_q_ok = row_ok & (tl.full([BLOCK_M], tree_row, tl.int32) >= 0)
        tree_rows = (tl.maximum(tree_row, 0) + q_pos).to(tl.int64)

    kv_end = tl.minimum(context_len + (local + 1) * BLOCK_Q, seq_len)  # keys up to the block's last row
    first_tile = 0
    if SLIDING_WINDOW > 0:  # tiles wholly before the first row's window are never read
        first_tile = tl.maximum(context_len + local * BLOCK_Q - SLIDING_WINDOW + 1, 0) // TILE
    for tile in range(first_tile, tl.cdiv(kv_end, TILE)):
        k_pos = tile * TILE + offs_t  # (T,)
        k_ok = k_pos < kv_end
        blk = tl.load(block_table_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + blk[None, :] * stride_k_blk + slot[None, :] * stride_k_pos
                    + kv_head * stride_k_head + offs_d[:, None],
                    mask=d_ok[:, None] & k_ok[None, :], other=0.0)  # (D, T)
        v = tl.load(v_cache_ptr + blk[:, None] * stride_v_blk + slot[:, None] * stride_v_pos
                    + kv_head * stride_v_head + offs_d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # (T, D)
        if DOT_FLOAT32:  # Triton's interpreter multiplies bfloat16 dot operands as raw integers
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = scale * tl.dot(q, k, input_precision=DOT_PRECISION)  # (M, T) float32
        if USE_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        visible = (k_pos[None, :] <= abs_pos[:, None]) & k_ok[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (abs_pos[:, None] - k_pos[None, :] < SLIDING_WINDOW)
        if USE_TREE:  # among the request's own query keys, a tree node sees its ancestors and itself only
            rel = k_pos - context_len
            in_tree = tree_q_ok[:, None] & ((rel >= 0) & (rel < tree_width) & k_ok)[None, :]
            allowed = tl.load(tree_mask_ptr + tree_rows[:, None] * stride_tree + rel[None, :], mask=in_tree, other=1)
            visible = visible & (allowed != 0)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # rows past the request's queries saw no key
    tl.store(out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def interpreter_active() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` was set before ``triton``
    was first imported, so that its library functions, ``tl.max`` and friends, are interpreted too)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(unified_attention_kernel, InterpretedFunction) and isinstance(tl.standard.max, InterpretedFunction)


def launch_shape(num_heads: int, num_kv_heads: int, head_size: int) -> dict[str, int]:
    """Tile sizes of a head configuration: ``BLOCK_M`` query rows per program (>= 16, a power of two,
    holding whole GQA groups), ``BLOCK_Q`` query tokens per program, ``HEAD_SIZE_PADDED`` (a power of
    two >= 16, for ``tl.dot``)."""
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    return {"NUM_QUERIES_PER_KV": group, "BLOCK_M": block_m, "BLOCK_Q": block_m // group,
            "HEAD_SIZE": head_size, "HEAD_SIZE_PADDED": max(16, triton.next_power_of_2(head_size))}


def unified_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                      sliding_window: int | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None, tree_rows: torch.Tensor | None = None,
                      tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal paged attention of a flattened batch (decodes and prefill chunks), into ``out``; with
    ``tree_rows``/``tree_mask``, draft-tree attention for the requests verifying a token tree.

    Launches one grid of ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)`` programs; no host
    synchronisation, no per-step host values beyond shapes (CUDA-graph capturable).

    Args:
        out: ``(num_tokens, num_heads, head_size)`` written in place, ``query.dtype``.
        query: ``(num_tokens, num_heads, head_size)``, float32/float16/bfloat16, last dim contiguous.
        k_cache, v_cache: ``(num_blocks, block_size, num_kv_heads, head_size)`` (``NHD`` pages, last dim
            contiguous), already holding this step's K/V.
        block_table: ``(num_reqs, max_blocks)`` int32 block ids (any value past a request's blocks).
        seq_lens: ``(num_reqs,)`` int32 tokens in KV after this step (context + query).
        query_start_loc: ``(num_reqs + 1,)`` int32 cumulative query lengths.
        scale: softmax scale.
        sliding_window: W: a query at position p sees keys at positions > p - W; ``None``: all.
        softcap: c: scores become ``c * tanh(score / c)`` after scaling, before the mask; ``None``: off.
        sinks: ``(num_heads,)`` per-head logits that join the softmax denominator only, or ``None``.
        tree_rows: ``(num_reqs,)`` int32: the first row of request ``r``'s block in ``tree_mask``, or -1 for a
            request without a tree this step (causal); ``None``: no tree in the batch.
        tree_mask: ``(num_tree_rows, tree_width)`` int8, last dim contiguous: row ``tree_rows[r] + j`` says which
            keys of request ``r``'s own query chunk (column ``m``: the key at position ``context_len + m``) query
            token ``j`` sees, 1 = visible: its ancestors and itself (vLLM's tree-attention bias rule,
            ``SpecTreeMask.visible``); context keys stay visible, columns past ``tree_width`` fall back to causal.
            Built by :func:`pack_tree_mask`.

    Returns:
        ``out``.

    Raises:
        RuntimeError: CPU tensors while Triton's interpreter is off (:func:`interpreter_active`).
        ValueError: only one of ``tree_rows`` and ``tree_mask`` given.
    """
    if (tree_rows is None) != (tree_mask is None):
        raise ValueError("tree attention needs tree_rows and tree_mask together (pack_tree_mask builds both)")
    num_tokens, num_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    shape = launch_shape(num_heads, num_kv_heads, head_size)
    num_seqs = seq_lens.shape[0]
    grid = (num_tokens // shape["BLOCK_Q"] + num_seqs, num_kv_heads)
    if query.device.type == "cpu" and not interpreter_active():
        raise RuntimeError("the triton attention kernel runs on CPU tensors only in Triton's interpreter: set "
                           "TRITON_INTERPRET=1 in the environment before triton is imported (or use a CUDA device)")
    unified_attention_kernel[grid](
        out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc, query if sinks is None else sinks,
        seq_lens if tree_rows is None else tree_rows, query if tree_mask is None else tree_mask,
        scale, 1.0 if softcap is None else softcap, num_seqs, 0 if tree_mask is None else tree_mask.stride(0),
        0 if tree_mask is None else tree_mask.shape[1],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_table.stride(0),
        BLOCK_SIZE=block_size, TILE=TILE_SIZE, SLIDING_WINDOW=sliding_window or 0, USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_FLOAT32=query.device.type == "cpu" and query.dtype == torch.bfloat16, USE_TREE=tree_rows is not None,
        **shape)
    return out


def pack_tree_mask(num_reqs: int, requests: list[int], visible: list[torch.Tensor],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's form of a verify step's draft trees (``SpecTreeMask``): every tree request's
    ``(query_len, query_len)`` visibility block stacked into one int8 matrix.

    Args:
        num_reqs: requests in the step.
        requests: batch indices of the tree requests (``SpecTreeMask.requests``).
        visible: per tree request, ``(query_len, query_len)`` bool (``SpecTreeMask.visible``), any device.
        device: where the kernel runs.

    Returns:
        ``tree_rows`` ``(num_reqs,)`` int32 (-1: no tree) and ``tree_mask`` ``(sum query_len, max query_len)``
        int8 (1 = visible; padding columns 0, never read: they lie past the request's keys), both on ``device``.
    """
    rows = torch.full((num_reqs,), -1, dtype=torch.int32)
    width = max(v.shape[1] for v in visible)
    mask = torch.zeros((sum(v.shape[0] for v in visible), width), dtype=torch.int8)
    start = 0
    for r, v in zip(requests, visible, strict=True):
        rows[r] = start
        mask[start:start + v.shape[0], :v.shape[1]] = v.to(torch.int8)
        start += v.shape[0]
    return rows.to(device), mask.to(device)
