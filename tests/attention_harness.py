"""Backend-agnostic harness: random mixed batches through any attention backend vs naive attention.

Imported as ``attention_harness`` (``tests/`` is on pytest's pythonpath) by the per-backend tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from framework.interfaces import AttentionBackend, CommonAttentionMetadata


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float) -> torch.Tensor:
    """Causal float32 reference. q: ``[Lq, H, D]`` at positions ``ctx_len..``; k/v: ``[ctx_len + Lq, KVH, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = torch.arange(q.shape[0], device=q.device)[:, None] + ctx_len
    scores = scores.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def common_metadata(spec: list[tuple[int, int]], tables: list[list[int]], slots: list[int], block_size: int,
                    device: torch.device) -> CommonAttentionMetadata:
    """Runner-style metadata for requests ``spec = [(context_len, query_len), ...]`` (decodes first)."""
    q_lens = [q for _, q in spec]
    seq_lens = [c + q for c, q in spec]
    bt = torch.zeros(len(spec), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    nd = 0
    while nd < len(q_lens) and q_lens[nd] == 1:
        nd += 1
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32, device=device),
        block_table=bt.to(device), slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, num_reqs=len(spec), num_tokens=sum(q_lens), num_decodes=nd,
        num_decode_tokens=nd, max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size)


def run_random_batch(make_backend: Callable[[int], AttentionBackend], spec: list[tuple[int, int]], seed: int = 0,
                     num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 8, block_size: int = 4,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Run one mixed batch (decodes first) with blocks scattered in the pool.

    Args:
        make_backend: ``block_size -> backend`` built for ``num_heads/num_kv_heads/head_size/dtype``.
        spec: ``[(context_len, query_len), ...]``; context is pre-filled in the cache.

    Returns:
        ``(out, expected)``: the backend's ``(num_tokens, H, D)`` output and the float32 reference.
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in spec) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    backend = make_backend(block_size)
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks), dtype=dtype, device=dev)
    tables, slots, qs, ks, vs, expected = [], [], [], [], [], []
    for c, q in spec:
        table = [perm.pop() for _ in range(-(-(c + q) // block_size))]
        tables.append(table)
        k_all = torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dev, dtype)
        v_all = torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dev, dtype)
        ctx_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)],
                                 dtype=torch.long, device=dev)
        backend.write_kv(cache, k_all[:c], v_all[:c], ctx_slots)  # the backend's own layout
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        qs.append(torch.randn(q, num_heads, head_size, generator=gen).to(dev, dtype))
        ks.append(k_all[c:])
        vs.append(v_all[c:])
        expected.append(naive_attention(qs[-1], k_all, v_all, c, head_size ** -0.5))
    meta = backend.build_metadata(common_metadata(spec, tables, slots, block_size, dev))
    out = backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta)
    return out, torch.cat(expected)


def run_same_step_prefix_hit(make_backend: Callable[[int], AttentionBackend], dtype: torch.dtype = torch.float32,
                             device: str = "cpu", block_size: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                             head_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The write-before-read contract: request B hits a prefix block that request A writes in this step.

    A prefills 2 blocks (tokens 0..2*bs-1); B shares A's first block as cached context (a prefix hit
    published this step) and computes one more block. A backend that attends before all of the
    step's K/V are written reads zeros for B's context and fails the comparison.

    Returns:
        ``(out_b, expected_b)`` for B's query tokens.
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(7)
    h, kvh, d, bs = num_heads, num_kv_heads, head_size, block_size
    backend = make_backend(bs)
    cache = torch.zeros(backend.get_kv_cache_shape(4), dtype=dtype, device=dev)
    k_a = torch.randn(2 * bs, kvh, d, generator=gen).to(dev, dtype)
    v_a = torch.randn(2 * bs, kvh, d, generator=gen).to(dev, dtype)
    k_b = torch.cat([k_a[:bs], torch.randn(bs, kvh, d, generator=gen).to(dev, dtype)])
    v_b = torch.cat([v_a[:bs], torch.randn(bs, kvh, d, generator=gen).to(dev, dtype)])
    q_a = torch.randn(2 * bs, h, d, generator=gen).to(dev, dtype)
    q_b = torch.randn(bs, h, d, generator=gen).to(dev, dtype)
    spec = [(0, 2 * bs), (bs, bs)]
    tables = [[0, 1], [0, 2]]
    slots = list(range(2 * bs)) + [2 * bs + i for i in range(bs)]
    meta = backend.build_metadata(common_metadata(spec, tables, slots, bs, dev))
    out = backend.forward(0, torch.cat([q_a, q_b]), torch.cat([k_a, k_b[bs:]]), torch.cat([v_a, v_b[bs:]]), cache,
                          meta)
    return out[2 * bs:], naive_attention(q_b, k_b, v_b, bs, d ** -0.5)
