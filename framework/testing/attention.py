"""Attention-backend conformance: a backend equals naive causal attention (the torch reference) on
seeded random mixed batches — decodes first, then first-chunk prefills and later chunks with cached
context — with GQA and blocks scattered through the pool; K/V land in the cache at ``slot_mapping``."""

from __future__ import annotations

import random
from typing import Any

import torch

from framework.interfaces import AttentionBackend, CommonAttentionMetadata


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                        scale: float) -> torch.Tensor:
    """Naive causal attention of one request, float32.

    Args:
        q: ``(query_len, num_heads, head_size)`` at positions ``context_len ..``.
        k, v: ``(context_len + query_len, num_kv_heads, head_size)``.
    Returns:
        ``(query_len, num_heads, head_size)``.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _batch(rng: random.Random) -> list[tuple[int, int]]:
    spec = [(rng.randint(0, 20), 1 if rng.random() < 0.5 else rng.randint(1, 10)) for _ in range(rng.randint(1, 6))]
    return sorted(spec, key=lambda cq: cq[1] != 1)  # decodes first, as the model runner orders them


def check_attention_backend(backend_cls: type[AttentionBackend], num_batches: int = 20, seed: int = 0,
                            dtype: torch.dtype = torch.float32, device: str = "cpu", atol: float = 1e-4,
                            num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 8, block_size: int = 4,
                            **params: Any) -> None:
    """Run ``num_batches`` random mixed batches through ``backend_cls(..., **params)`` and compare with
    :func:`reference_attention` (``atol`` absolute, float32 reference); the cached context is stored
    with the backend's own ``write_kv``; also checks each new token's K/V reads back at its
    ``slot_mapping`` slot through ``read_kv``, and that ``copy_blocks``
    (swap preemption) round-trips every block through a CPU cache under a block permutation unchanged.

    Raises:
        AssertionError: naming the batch (``(context_len, query_len)`` per request) that differs.
    """
    dev = torch.device(device)
    scale = head_size ** -0.5
    backend = backend_cls(num_heads, num_kv_heads, head_size, scale, block_size, dtype, dev, **params)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(num_batches):
        spec = _batch(rng)
        num_blocks = sum(-(-(c + q) // block_size) for c, q in spec) + 3
        free = list(range(num_blocks))
        rng.shuffle(free)
        cache = torch.zeros(backend.get_kv_cache_shape(num_blocks), dtype=dtype, device=dev)
        tables, kvs, slots, qs = [], [], [], []
        for c, q in spec:
            table = [free.pop() for _ in range(-(-(c + q) // block_size))]
            k_all = torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dtype)
            v_all = torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dtype)
            ctx_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)],
                                     dtype=torch.long, device=dev)
            backend.write_kv(cache, k_all[:c].to(dev), v_all[:c].to(dev), ctx_slots)  # cached context, its layout
            slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
            tables.append(table)
            kvs.append((k_all, v_all))
            qs.append(torch.randn(q, num_heads, head_size, generator=gen).to(dtype))
        q_lens, seq_lens = [q for _, q in spec], [c + q for c, q in spec]
        bt = torch.zeros(len(spec), max(map(len, tables)), dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t)
        nd = sum(q == 1 for q in q_lens)
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32).to(dev), block_table=bt.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev), query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
            num_reqs=len(spec), num_tokens=sum(q_lens), num_decodes=nd, num_decode_tokens=nd,
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=block_size)
        key = torch.cat([k[c:] for (k, _), (c, _) in zip(kvs, spec)]).to(dev)
        value = torch.cat([v[c:] for (_, v), (c, _) in zip(kvs, spec)]).to(dev)
        out = backend.forward(0, torch.cat(qs).to(dev), key, value, cache, backend.build_metadata(common))
        expected = torch.cat([reference_attention(qs[i].float(), kvs[i][0].float(), kvs[i][1].float(), spec[i][0],
                                                  scale) for i in range(len(spec))])
        assert out.shape == expected.shape, f"{backend_cls.name}: output shape {tuple(out.shape)} != {expected.shape}"
        err = (out.float().cpu() - expected).abs().max().item()
        assert err <= atol, f"{backend_cls.name}: max |out - reference| = {err:.3g} > {atol} on batch {spec}"
        stored_k, stored_v = backend.read_kv(cache, torch.tensor(slots, dtype=torch.long, device=dev))
        assert torch.equal(stored_k.float().cpu(), key.float().cpu()) and torch.equal(stored_v.float().cpu(),
                                                                                     value.float().cpu()), \
            f"{backend_cls.name}: K/V not written at slot_mapping on batch {spec} (or read_kv disagrees with write_kv)"
        ids = list(range(num_blocks))
        perm = ids[::-1]
        host = [torch.zeros_like(cache, device="cpu")]
        backend.copy_blocks([cache], ids, host, perm)
        back = [torch.zeros_like(cache)]
        backend.copy_blocks(host, perm, back, ids)
        assert torch.equal(back[0], cache), f"{backend_cls.name}: copy_blocks does not round-trip whole blocks"
