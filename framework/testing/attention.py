"""Attention-backend conformance: a backend equals naive causal attention (the torch reference) on
seeded random mixed batches — decodes first, then first-chunk prefills and later chunks with cached
context — with GQA and blocks scattered through the pool; K/V land in the cache at ``slot_mapping``.
Layers with the features a backend declares (sliding window, softcap, sinks) are checked on the same
batches against transformers' semantics of each; MLA's latent cache on request (``latent=True``)."""

from __future__ import annotations

import random
from typing import Any

import torch

from framework.interfaces import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata
from framework.interfaces.attention import LAYER_FEATURES

#: Window of the conformance suite's sliding-window layer: not a multiple of its block size (4), and
#: smaller than its longest contexts (30 tokens), so chunks and decodes both lose keys to it.
WINDOW = 5
#: Softcap of its softcapped layer, small enough to bend scores of random unit-variance q/k.
SOFTCAP = 0.5


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                        scale: float, sliding_window: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Naive causal attention of one request, float32, with transformers 5's layer features.

    Args:
        q: ``(query_len, num_heads, head_size)`` at positions ``context_len ..``.
        k, v: ``(context_len + query_len, num_kv_heads, head_size)``.
        sliding_window: W: a query at position p sees keys at positions > p - W.
        softcap: c: scores become ``c * tanh(scores / c)`` after scaling, before the mask.
        sinks: ``(num_heads,)`` logits that join the softmax denominator only.
    Returns:
        ``(query_len, num_heads, head_size)``.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(q.shape[0])[:, None] + context_len
    k_pos = torch.arange(k.shape[0])[None, :]
    masked = k_pos > q_pos
    if sliding_window is not None:
        masked |= k_pos <= q_pos - sliding_window
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is not None:
        probs = torch.cat([scores, sinks.float()[:, None, None].expand(-1, q.shape[0], 1)], -1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def conformance_layers(backend_cls: type[AttentionBackend], num_heads: int, num_kv_heads: int,
                       head_size: int) -> list[AttentionLayerSpec]:
    """The suite's layers: a plain one, then one per feature the backend declares, then all of them."""
    plain = AttentionLayerSpec(num_heads, num_kv_heads, head_size, head_size)
    values = {"sliding_window": WINDOW, "softcap": SOFTCAP, "has_sinks": True}
    declared = [f for f, attribute in LAYER_FEATURES.items() if getattr(backend_cls, attribute)]
    layers = [plain] + [AttentionLayerSpec(**{**vars(plain), f: values[f]}) for f in declared]
    if len(declared) > 1:
        layers.append(AttentionLayerSpec(**{**vars(plain), **{f: values[f] for f in declared}}))
    return layers


def _batch(rng: random.Random) -> list[tuple[int, int]]:
    spec = [(rng.randint(0, 20), 1 if rng.random() < 0.5 else rng.randint(1, 10)) for _ in range(rng.randint(1, 6))]
    return sorted(spec, key=lambda cq: cq[1] != 1)  # decodes first, as the model runner orders them


def check_attention_backend(backend_cls: type[AttentionBackend], num_batches: int = 20, seed: int = 0,
                            dtype: torch.dtype = torch.float32, device: str = "cpu", atol: float = 1e-4,
                            num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 8, block_size: int = 4,
                            latent: bool = False, **params: Any) -> None:
    """Run ``num_batches`` random mixed batches through ``backend_cls(..., **params)`` and compare with
    :func:`reference_attention` (``atol`` absolute, float32 reference) on every layer of
    :func:`conformance_layers` (plain, and each feature the backend declares: window, softcap, sinks);
    the cached context is stored with the backend's own ``write_kv``; also checks each new token's K/V
    reads back at its ``slot_mapping`` slot through ``read_kv``, and that ``copy_blocks``
    (swap preemption) round-trips every block through a CPU cache under a block permutation unchanged.
    ``latent=True`` checks MLA's latent cache instead (a backend declaring ``supports_latent_kv``): one layer
    with ``latent_kv``, one KV head, and V equal to K (the bridge keeps the first ``value_head_size`` channels).

    Raises:
        AssertionError: naming the batch (``(context_len, query_len)`` per request) that differs.
    """
    dev = torch.device(device)
    scale = head_size ** -0.5
    if latent:
        num_kv_heads, layers = 1, [AttentionLayerSpec(num_heads, 1, head_size, head_size // 2, latent_kv=True)]
    else:
        layers = conformance_layers(backend_cls, num_heads, num_kv_heads, head_size)
    backend = backend_cls(num_heads, num_kv_heads, head_size, scale, block_size, dtype, dev, layers=layers, **params)
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(dev)
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
            v_all = k_all if latent else torch.randn(c + q, num_kv_heads, head_size, generator=gen).to(dtype)
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
        metadata = backend.build_metadata(common)
        for layer_idx, layer in enumerate(layers):
            features = {"sliding_window": layer.sliding_window, "softcap": layer.softcap,
                        "sinks": sinks if layer.has_sinks else None}
            out = backend.forward(layer_idx, torch.cat(qs).to(dev), key, value, cache, metadata,
                                  **{name: x for name, x in features.items() if x is not None})
            host_sinks = sinks.float().cpu() if layer.has_sinks else None
            expected = torch.cat([reference_attention(qs[i].float(), kvs[i][0].float(), kvs[i][1].float(), spec[i][0],
                                                      scale, layer.sliding_window, layer.softcap, host_sinks)
                                  for i in range(len(spec))])
            what = f"{backend_cls.name} (layer {layer})"
            assert out.shape == expected.shape, f"{what}: output shape {tuple(out.shape)} != {expected.shape}"
            err = (out.float().cpu() - expected).abs().max().item()
            assert err <= atol, f"{what}: max |out - reference| = {err:.3g} > {atol} on batch {spec}"
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
