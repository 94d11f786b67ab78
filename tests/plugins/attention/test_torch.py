"""The torch paged-attention backend equals naive causal attention per request, for mixed batches of
decodes, first-chunk prefills and later chunks with cached context, with GQA and shuffled blocks, and
with prefill chunks split into causal query tiles of any size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.interfaces import CommonAttentionMetadata
from plugins.attention.torch import QueryTile, TorchAttentionBackend, length_buckets, query_tiles

H, KVH, D, BS = 4, 2, 8, 4


def _naive(q, k, v, ctx_len):
    """q: [Lq, H, D] at positions ctx_len.., k/v: [ctx_len + Lq, KVH, D] -> [Lq, H, D]."""
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
    q_pos = torch.arange(q.shape[0])[:, None] + ctx_len
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run(spec, seed=0, dtype=torch.float32, decode_kernel="packed", prefill_kernel="packed", prefill_tile=64):
    """spec: list of (context_len, query_len); decodes (query_len 1) must come first."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // BS) for c, q in spec) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered in the pool
    backend = TorchAttentionBackend(H, KVH, D, D ** -0.5, BS, dtype, torch.device("cpu"), decode_kernel=decode_kernel,
                                    prefill_kernel=prefill_kernel, prefill_tile=prefill_tile)
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks), dtype=dtype)
    tables, full_kv, slots, qs, ks, vs = [], [], [], [], [], []
    for c, q in spec:
        n_blocks = -(-(c + q) // BS)
        table = [perm.pop() for _ in range(n_blocks)]
        tables.append(table)
        k_all = torch.randn(c + q, KVH, D, generator=gen, dtype=dtype)
        v_all = torch.randn(c + q, KVH, D, generator=gen, dtype=dtype)
        full_kv.append((k_all, v_all))
        for pos in range(c):  # context already in the cache
            cache[0, table[pos // BS], pos % BS] = k_all[pos]
            cache[1, table[pos // BS], pos % BS] = v_all[pos]
        slots += [table[p // BS] * BS + p % BS for p in range(c, c + q)]
        qs.append(torch.randn(q, H, D, generator=gen, dtype=dtype))
        ks.append(k_all[c:])
        vs.append(v_all[c:])
    q_lens = [q for _, q in spec]
    seq_lens = [c + q for c, q in spec]
    bt = torch.zeros(len(spec), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    nd = sum(1 for q in q_lens if q == 1)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32),
        block_table=bt, slot_mapping=torch.tensor(slots), query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        num_reqs=len(spec), num_tokens=sum(q_lens), num_decodes=nd, num_decode_tokens=nd,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=BS)
    meta = backend.build_metadata(common)
    out = backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta)
    expected = torch.cat([_naive(qs[i].float(), full_kv[i][0].float(), full_kv[i][1].float(), spec[i][0])
                          for i in range(len(spec))])
    return out, expected, cache, tables, full_kv


@pytest.mark.parametrize("decode_kernel", TorchAttentionBackend.DECODE_KERNELS)
@pytest.mark.parametrize("prefill_kernel", TorchAttentionBackend.PREFILL_KERNELS)
@pytest.mark.parametrize("prefill_tile", [0, 1, 3, 64])
def test_mixed_batch_matches_naive(decode_kernel, prefill_kernel, prefill_tile):
    out, expected, *_ = _run([(5, 1), (0, 1), (12, 1), (0, 7), (9, 6), (3, 1 + BS * 2)], decode_kernel=decode_kernel,
                             prefill_kernel=prefill_kernel, prefill_tile=prefill_tile)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_query_tiles_split_chunks_causally():
    """Each chunk splits into tiles of ``tile`` queries (the last one shorter), each seeing its context,
    the earlier tiles and itself; 0 keeps whole chunks."""
    # request 0: decode, request 1: 7 queries after 2 cached tokens, request 2: 3 queries, no context
    assert query_tiles([1, 2], [1, 7, 3], [6, 9, 3], 3) == [
        QueryTile(1, 0, 3, 5), QueryTile(1, 3, 3, 8), QueryTile(1, 6, 1, 9), QueryTile(2, 0, 3, 3)]
    assert query_tiles([1, 2], [1, 7, 3], [6, 9, 3], 0) == [QueryTile(1, 0, 7, 9), QueryTile(2, 0, 3, 3)]


def test_tiled_prefill_equals_whole_chunks_in_bfloat16():
    """Tiles change which keys the flash kernel visits (only the causal ones), not the result beyond
    bf16 rounding of its blocked softmax."""
    spec = [(3, 1), (0, 70), (20, 33), (0, 5)]
    whole, *_ = _run(spec, dtype=torch.bfloat16, prefill_tile=0)
    tiled, expected, *_ = _run(spec, dtype=torch.bfloat16, prefill_tile=16)
    torch.testing.assert_close(tiled.float(), whole.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(tiled.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_prefill_equals_gqa_prefill(dtype):
    """Both prefill layouts run the same flash kernel over the same keys: equal up to its blocking
    (bucketed chunks of different lengths, cached context, padding rows)."""
    spec = [(5, 1), (0, 3), (30, 9), (2, 2), (0, 40), (11, 4)]
    packed, *_ = _run(spec, dtype=dtype)
    gqa, *_ = _run(spec, dtype=dtype, prefill_kernel="gqa")
    torch.testing.assert_close(packed.float(), gqa.float(), rtol=1e-2, atol=1e-2)


def test_prefill_requests_bucketed_by_length():
    """Prefill requests of very different lengths go into separate padded segments (each within 1.5x),
    whose outputs land back at their own tokens; lengths within 1.5x stay one in-order segment."""
    assert length_buckets([0, 1, 2, 3, 4], [100, 10, 90, 12, 40]) == [[0, 2], [4], [1, 3]]
    assert length_buckets([0, 1], [10, 15]) == [[0, 1]]
    spec = [(5, 1), (0, 3), (30, 9), (2, 2), (0, 40), (11, 4)]  # decode, then chunks from 2 to 40 keys
    out, expected, *_ = _run(spec)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    backend = TorchAttentionBackend(H, KVH, D, D ** -0.5, BS, torch.float32, torch.device("cpu"))
    seq_lens = [c + q for c, q in spec]
    assert len(length_buckets(list(range(1, len(spec))), seq_lens)) >= 3
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 4, 13, 15, 55, 59], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32),
        block_table=torch.zeros(len(spec), 13, dtype=torch.int32), slot_mapping=torch.arange(59),
        query_lens_cpu=[q for _, q in spec], seq_lens_cpu=seq_lens, num_reqs=6, num_tokens=59, num_decodes=1,
        num_decode_tokens=1, max_query_len=40, max_seq_len=40, block_size=BS)
    segments = backend.build_metadata(common).segments
    assert len(segments) >= 4 and all(seg.token_index is not None for seg in segments[1:])
    assert sorted(torch.cat([seg.token_index for seg in segments[1:]]).tolist()) == list(range(1, 59))


def test_cache_written_through_slot_mapping():
    spec = [(2, 1), (0, 9)]
    _, _, cache, tables, full_kv = _run(spec)
    for (c, q), table, (k_all, v_all) in zip(spec, tables, full_kv):
        for pos in range(c + q):
            torch.testing.assert_close(cache[0, table[pos // BS], pos % BS], k_all[pos])
            torch.testing.assert_close(cache[1, table[pos // BS], pos % BS], v_all[pos])


def test_bfloat16_close_to_float32_reference():
    out, expected, *_ = _run([(4, 1), (0, 5), (6, 3)], dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 10)), min_size=1, max_size=6), st.integers(0, 1000),
       st.sampled_from([0, 1, 2, 5, 64]))
def test_random_batches_match_naive(spec, seed, prefill_tile):
    spec = sorted(spec, key=lambda cq: cq[1] != 1)  # decodes first, as the model runner orders them
    out, expected, *_ = _run(spec, seed=seed, prefill_tile=prefill_tile)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_unknown_decode_kernel_rejected():
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        TorchAttentionBackend(H, KVH, D, 1.0, BS, torch.float32, torch.device("cpu"), decode_kernel="matmul")
    with pytest.raises(ValueError, match="prefill_kernel must be one of"):
        TorchAttentionBackend(H, KVH, D, 1.0, BS, torch.float32, torch.device("cpu"), prefill_kernel="matmul")
    with pytest.raises(ValueError, match="prefill_tile must be >= 0"):
        TorchAttentionBackend(H, KVH, D, 1.0, BS, torch.float32, torch.device("cpu"), prefill_tile=-1)


def test_unknown_param_rejected():
    with pytest.raises(TypeError, match="unknown parameters"):
        TorchAttentionBackend(H, KVH, D, 1.0, BS, torch.float32, torch.device("cpu"), window=4)


def test_kv_cache_shape_and_bytes_per_block():
    backend = TorchAttentionBackend(num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5, block_size=16,
                                    dtype=torch.float16, device=torch.device("cpu"))
    assert backend.get_kv_cache_shape(10) == (2, 10, 16, 2, 8)
    assert backend.kv_cache_bytes_per_block(num_layers=3) == 2 * 16 * 2 * 8 * 3 * 2  # K+V, fp16 = 2 bytes


def test_default_traceable_forward_runs_forward_with_the_inputs():
    """A backend whose ``forward`` is traceable only overrides ``traceable_inputs`` (returning its
    metadata): the default ``traceable_forward`` then gives what ``forward`` gives, cache included."""
    class Traceable(TorchAttentionBackend):
        def traceable_inputs(self, metadata):
            return metadata

    backend = Traceable(H, KVH, D, D ** -0.5, BS, torch.float32, torch.device("cpu"))
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), seq_lens=torch.tensor([6, 1], dtype=torch.int32),
        context_lens=torch.tensor([5, 0], dtype=torch.int32), block_table=torch.tensor([[0, 1], [2, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([5, 8]), query_lens_cpu=[1, 1], seq_lens_cpu=[6, 1], num_reqs=2, num_tokens=2,
        num_decodes=2, num_decode_tokens=2, max_query_len=1, max_seq_len=6, block_size=BS)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(backend.get_kv_cache_shape(3), generator=gen)
    traced_cache = cache.clone()
    q, k, v = torch.randn(2, H, D, generator=gen), torch.randn(2, KVH, D, generator=gen), torch.randn(2, KVH, D, generator=gen)
    meta = backend.build_metadata(common)
    expected = backend.forward(0, q, k, v, cache, meta)
    out = backend.traceable_forward(0, q, k, v, traced_cache, backend.traceable_inputs(meta))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(traced_cache, cache)
