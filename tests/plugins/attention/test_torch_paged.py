"""The torch_paged backend (cache read in place, inductor-compiled) equals the torch reference backend
on mixed batches: decodes, first chunks and chunks with cached context, varied block sizes, block
tables and GQA ratios, with every token in place (``paged_prefill``) and with the default split
(decodes in place, chunks through the reference); its size rule picks the path it documents; and
greedy engine output equals transformers (SmolLM2's, chunked and prefix-cached:
``tests/framework/engine/test_parity_smollm2.py::test_chunked_prefill_and_prefix_caching``)."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES, hf_greedy
from hypothesis import given, settings
from hypothesis import strategies as st

from framework import SamplingParams
from framework.interfaces import AttentionLayerSpec, CommonAttentionMetadata
from framework.testing.attention import WINDOW, check_attention_backend, conformance_layers, reference_attention
from plugins.attention import torch_paged
from plugins.attention._paged_kernel import (
    MIN_PARTITIONS,
    PARTITION_BLOCKS,
    cache_shape,
    kv_partitions,
    write_kv,
    write_kv_in_graph,
)
from plugins.attention.torch import TorchAttentionBackend
from plugins.attention.torch_paged import TorchPagedAttentionBackend

D = 8


def _common(spec, tables, slots, bs):
    q_lens = [q for _, q in spec]
    seq_lens = [c + q for c, q in spec]
    bt = torch.zeros(len(spec), max(len(t) for t in tables) + 1, dtype=torch.int32)  # a spare column, as in the runner
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    nd = sum(1 for q in q_lens if q == 1)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32),
        block_table=bt, slot_mapping=torch.tensor(slots), query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        num_reqs=len(spec), num_tokens=sum(q_lens), num_decodes=nd, num_decode_tokens=nd,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), block_size=bs)


def _run(spec, heads=4, kv_heads=2, bs=4, seed=0, dtype=torch.float32, compile=False, paged_prefill=True):
    """spec: (context_len, query_len) per request, decodes first. Returns (paged out, torch-reference out).

    Every decode goes through the in-place kernel (``min_paged_decodes=1``); chunks too unless
    ``paged_prefill`` is False."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(64, sum(-(-(c + q) // bs) for c, q in spec) + 3)  # fixed pool, as in an engine
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    args = (heads, kv_heads, D, D ** -0.5, bs, dtype, torch.device("cpu"))
    paged = TorchPagedAttentionBackend(*args, compile=compile, min_paged_decodes=1, paged_prefill=paged_prefill)
    ref = TorchAttentionBackend(*args)
    cache = torch.zeros(paged.get_kv_cache_shape(num_blocks), dtype=dtype)
    ref_cache = torch.zeros(ref.get_kv_cache_shape(num_blocks), dtype=dtype)
    tables, slots, qs, ks, vs = [], [], [], [], []
    for c, q in spec:
        table = [perm.pop() for _ in range(-(-(c + q) // bs))]
        tables.append(table)
        k_all = torch.randn(c + q, kv_heads, D, generator=gen).to(dtype)
        v_all = torch.randn(c + q, kv_heads, D, generator=gen).to(dtype)
        ctx_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)], dtype=torch.long)
        paged.write_kv(cache, k_all[:c], v_all[:c], ctx_slots)  # each backend's own layout
        ref.write_kv(ref_cache, k_all[:c], v_all[:c], ctx_slots)
        slots += [table[p // bs] * bs + p % bs for p in range(c, c + q)]
        qs.append(torch.randn(q, heads, D, generator=gen).to(dtype))
        ks.append(k_all[c:])
        vs.append(v_all[c:])
    common = _common(spec, tables, slots, bs)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    out = paged.forward(0, q, k, v, cache, paged.build_metadata(common))
    expected = ref.forward(0, q, k, v, ref_cache, ref.build_metadata(common))
    every_slot = torch.arange(num_blocks * bs)
    for got, want in zip(paged.read_kv(cache, every_slot), ref.read_kv(ref_cache, every_slot)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # identical K/V at every slot
    return out, expected


MIXED = [(5, 1), (0, 1), (12, 1), (0, 7), (9, 6), (3, 9)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (4, 1)])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_eager_matches_reference(heads, kv_heads, bs):
    out, expected = _run(MIXED, heads, kv_heads, bs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 10)), min_size=1, max_size=6),
       st.sampled_from([(4, 2), (6, 3), (8, 1)]), st.sampled_from([2, 4, 8]), st.integers(0, 1000))
def test_random_batches_match_reference(spec, gqa, bs, seed):
    spec = sorted(spec, key=lambda cq: cq[1] != 1)  # decodes first, as the model runner orders them
    for paged_prefill in (True, False):
        out, expected = _run(spec, *gqa, bs=bs, seed=seed, paged_prefill=paged_prefill)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_size_rule_picks_the_path():
    """Decodes go in place from ``min_paged_decodes`` of them; chunks never unless ``paged_prefill`` (the
    metadata only: no kernel is compiled)."""
    def backend(**kwargs) -> TorchPagedAttentionBackend:
        return TorchPagedAttentionBackend(4, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"), compile=False,
                                          **kwargs)

    spec, tables, slots = [(5, 1), (3, 1), (0, 3)], [[0, 1], [2], [3]], [5, 3 + 8, 12, 13, 14]
    common = _common(spec, tables, slots, 4)
    step = backend(min_paged_decodes=2).build_metadata(common)
    assert step.num_paged_tokens == 2 and step.paged.kv.num_partitions.shape[0] == 2 and step.reference is not None
    step = backend(min_paged_decodes=3).build_metadata(common)
    assert step.num_paged_tokens == 0 and step.paged is None
    step = backend(paged_prefill=True).build_metadata(common)
    assert step.num_paged_tokens == 5 and step.reference is None
    with pytest.raises(ValueError, match="min_paged_decodes"):
        backend(min_paged_decodes=0)


def test_compiled_matches_reference_without_recompiles():
    """After warm-up, later batch shapes (tokens, context, requests, table width) reuse the compiled graph."""
    out, expected = _run(MIXED, 6, 2, 4, compile=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    graphs = torch_paged.COMPILE_STATS["graphs"]
    assert graphs >= 1
    for seed, spec in enumerate([[(7, 1), (30, 1), (0, 5)], [(2, 1), (11, 1), (40, 3), (1, 8)], [(20, 4), (0, 2)]]):
        out, expected = _run(spec, 6, 2, 4, seed=seed, compile=True)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch_paged.COMPILE_STATS["graphs"] == graphs, "a new batch shape recompiled the kernel"


def test_compiled_bfloat16_close_to_reference():
    out, expected = _run([(4, 1), (0, 5), (6, 3)], dtype=torch.bfloat16, compile=True)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    backend = TorchPagedAttentionBackend(4, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"),
                                         compile=False, paged_prefill=True)  # any kernel but the eager one may fail
    monkeypatch.setattr(backend, "_fn", broken)
    spec, tables, slots = [(0, 3)], [[0]], [0, 1, 2]
    cache = torch.zeros(backend.get_kv_cache_shape(2))
    q, kv = torch.randn(3, 4, D), torch.randn(3, 2, D)
    with caplog.at_level("WARNING"):
        out = backend.forward(0, q, kv, kv, cache, backend.build_metadata(_common(spec, tables, slots, 4)))
    assert "falling back to eager" in caplog.text and backend._fn is torch_paged.paged_attention
    assert out.shape == (3, 4, D) and torch.isfinite(out).all()


def test_engine_greedy_parity_chunked_preempted_prefix_cached(make_llm):
    """stories260K float32 through the engine with torch_paged: chunked prefill, preemption, prefix hits."""
    llm = make_llm(attention="torch_paged", attention_params={"min_paged_decodes": 2}, num_blocks=36,
                   block_size=16, max_num_batched_tokens=24, long_prefill_token_threshold=16,
                   enable_prefix_caching=True)
    tok = llm.get_tokenizer()
    prefix = "Once upon a time, in a small town, there lived a kind old man who had a garden full of flowers. "
    prompts = [prefix + t for t in ["One day", "He had a dog.", "A girl came by and asked", "The birds sang"]]
    prompts += ["Lily", "The dog ran to the park and", "Max had a toy car", "Tom and Sue were friends. They liked to"]
    ids = [tok(p).input_ids for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=48))
    for i, (out, exp) in enumerate(zip(outs, hf_greedy(STORIES, ids, 48))):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
    summary = llm.engine.metrics.summary()
    assert summary["num_preemptions"] > 0


def test_construction_compiles_so_the_first_large_step_does_not():
    """The kernel compiles in ``__init__`` (a dummy call); a real decode step of another size, cache
    and table width then reuses that graph instead of stalling on inductor mid-run. (float32, the dtype every
    CPU runs natively: a bf16 compile on an AVX2-only CPU would cost a cold compile of emulated code here.)"""
    torch._dynamo.reset()  # as in a fresh engine process: no graph of the earlier tests' shapes and dynamism
    torch_paged._COMPILED.clear()
    backend = TorchPagedAttentionBackend(6, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"))
    graphs = torch_paged.COMPILE_STATS["graphs"]
    assert graphs >= 1
    spec = [(9 + i, 1) for i in range(10)]
    tables = [[5 * i + j for j in range(5)] for i in range(10)]
    slots = [tables[i][c // 4] * 4 + c % 4 for i, (c, _) in enumerate(spec)]
    cache = torch.zeros(backend.get_kv_cache_shape(50), dtype=torch.float32)  # as in the engine: the cache
    with torch.inference_mode():  # is allocated at start-up, the step's tensors are inference tensors
        q, kv = torch.randn(10, 6, D), torch.randn(10, 2, D)
        step = backend.build_metadata(_common(spec, tables, slots, 4))
        assert step.num_paged_tokens == 10
        backend.forward(0, q, kv, kv, cache, step)
    assert torch_paged.COMPILE_STATS["graphs"] == graphs


def test_quantized_cache_runs_through_the_reference():
    """``kv_cache_dtype=int8``: the reference's quantized layout, no in-place part, same output."""
    args = (4, 2, D, D ** -0.5, 4, torch.int8, torch.device("cpu"))
    paged, ref = TorchPagedAttentionBackend(*args, min_paged_decodes=1), TorchAttentionBackend(*args)
    assert not paged.in_place and paged.get_kv_cache_shape(3) == ref.get_kv_cache_shape(3) == (2, 3, 4, 2, D + 4)
    spec, tables, slots = [(5, 1), (3, 1)], [[0, 1], [2]], [5, 11]
    common = _common(spec, tables, slots, 4)
    step = paged.build_metadata(common)
    assert step.paged is None and step.num_paged_tokens == 0
    cache = torch.zeros(paged.get_kv_cache_shape(4), dtype=paged.cache_dtype)
    ref_cache = cache.clone()
    q, kv = torch.randn(2, 4, D), torch.randn(2, 2, D)
    out = paged.forward(0, q, kv, kv, cache, step)
    expected = ref.forward(0, q, kv, kv, ref_cache, ref.build_metadata(common))
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    torch.testing.assert_close(out, expected)


DECODE_SPEC, DECODE_TABLES = [(5, 1), (0, 1), (13, 1)], [[4, 7], [2], [0, 9, 3, 5]]  # three decodes, block 4
DECODE_SLOTS = [DECODE_TABLES[i][c // 4] * 4 + c % 4 for i, (c, _) in enumerate(DECODE_SPEC)]


def _decode_step(backend: TorchPagedAttentionBackend, gen: torch.Generator) -> tuple:
    """A 10-block cache holding the contexts of :data:`DECODE_SPEC` (5, 0 and 13 tokens; 6 query / 2 KV
    heads of ``D``), one new token's ``q (3, 6, D)``, ``k``/``v (3, 2, D)`` and the step's metadata:
    ``(cache, q, k, v, step)``."""
    cache = torch.zeros(backend.get_kv_cache_shape(10))
    for (c, _), table in zip(DECODE_SPEC, DECODE_TABLES):
        ctx = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(c)], dtype=torch.long)
        backend.write_kv(cache, torch.randn(c, 2, D, generator=gen), torch.randn(c, 2, D, generator=gen), ctx)
    q, k, v = torch.randn(3, 6, D, generator=gen), torch.randn(3, 2, D, generator=gen), torch.randn(3, 2, D, generator=gen)
    return cache, q, k, v, backend.build_metadata(_common(DECODE_SPEC, DECODE_TABLES, DECODE_SLOTS, 4))


def test_traceable_forward_equals_forward_on_decode_steps():
    """An all-decode step offers traceable inputs (what ``engine.compile`` traces into the decoder
    graph): ``traceable_forward`` writes the same K/V and returns the same output as ``forward``
    (the reference's gather + SDPA for this small batch). Steps with a chunk, and quantized caches,
    offer none (they take ``forward`` through the opaque op)."""
    args = (6, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"))
    backend = TorchPagedAttentionBackend(*args, compile=False)
    gen = torch.Generator().manual_seed(3)
    spec, tables, slots = DECODE_SPEC, DECODE_TABLES, DECODE_SLOTS
    cache, q, k, v, step = _decode_step(backend, gen)
    inputs = backend.traceable_inputs(step)
    assert inputs is not None and inputs.kv.block_tables.shape == (3, PARTITION_BLOCKS)  # one 16-key partition each
    assert inputs.kv.kv_lens.tolist() == [6, 1, 14] and inputs.kv.partitions.shape == (3, MIN_PARTITIONS)
    traced_cache = cache.clone()
    expected = backend.forward(0, q, k, v, cache, step)
    out = backend.traceable_forward(0, q, k, v, traced_cache, inputs)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(traced_cache, cache, rtol=0, atol=0)

    mixed = backend.build_metadata(_common([(5, 1), (0, 3)], [[4, 7], [2]], [tables[0][1] * 4 + 1, 8, 9, 10], 4))
    assert backend.traceable_inputs(mixed) is None
    quantized = TorchPagedAttentionBackend(*args[:5], torch.int8, args[6], compile=False)
    assert quantized.traceable_inputs(quantized.build_metadata(_common(spec, tables, slots, 4))) is None


def test_blocks_are_stored_head_major():
    """The layout: key block ``[kv_heads, head_size, block_size]``, value block ``[kv_heads, block_size,
    head_size]``; ``read_kv`` inverts ``write_kv``; a hybrid pairing it with an NHD backend is refused."""
    from plugins.attention._paged_kernel import key_blocks, value_blocks

    backend = TorchPagedAttentionBackend(4, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"), compile=False)
    cache = torch.zeros(backend.get_kv_cache_shape(3))
    key, value = torch.randn(2, 2, D), torch.randn(2, 2, D)
    slots = torch.tensor([6, 9])  # block 1 offset 2, block 2 offset 1
    backend.write_kv(cache, key, value, slots)
    assert cache.shape == (2, 3, 2, 4 * D)  # (2, num_blocks, kv_heads, block_size * head_size)
    assert torch.equal(key_blocks(cache, D)[1, :, :, 2], key[0]) and torch.equal(key_blocks(cache, D)[2, :, :, 1], key[1])
    assert torch.equal(value_blocks(cache, D)[1, :, 2], value[0])
    assert torch.equal(value_blocks(cache, D)[2, :, 1], value[1])
    assert torch.equal(cache[1, 1].reshape(2, 4, D)[:, 2], value[0])  # head-major within the block
    assert torch.equal(cache[0, 1].reshape(2, D, 4)[:, :, 2], key[0])  # keys transposed within the head
    got_k, got_v = backend.read_kv(cache, slots)
    assert torch.equal(got_k, key) and torch.equal(got_v, value)
    assert backend.kv_cache_layout == "HDN" and TorchAttentionBackend.kv_cache_layout == "NHD"
    from plugins.attention.hybrid import HybridBackend

    with pytest.raises(ValueError, match="different KV-cache layouts"):
        HybridBackend(4, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"), prefill="torch", decode="torch_paged",
                      decode_params={"compile": False})


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(4, 2), (3, 3), (2, 1)]), st.sampled_from([1, 4, 16]), st.integers(1, 9), st.integers(0, 2**31))
def test_write_kv_in_graph_stores_what_write_kv_stores(heads, bs, num_tokens, seed):
    """The traced write's ``index_put_`` on the cache's own dims lands every element where the eager
    view-based ``write_kv`` puts it (and nothing else changes), for varied block sizes and heads."""
    kv_heads, d = heads[1], 8
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    cache = torch.randn(cache_shape(num_blocks, bs, kv_heads, d), generator=gen)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]
    key, value = torch.randn(len(slots), kv_heads, d, generator=gen), torch.randn(len(slots), kv_heads, d, generator=gen)
    write_kv(expected, key, value, slots)
    write_kv_in_graph(cache, key, value, slots)
    assert torch.equal(cache, expected)


def test_write_kv_in_graph_compiles_in_place():
    """Compiled, the write mutates the cache input in place: same stores as ``write_kv``, and the
    generated code allocates no cache-sized buffer (a view-based write made inductor copy the cache)."""
    from torch._inductor.utils import run_and_get_code

    cache, expected = torch.zeros(cache_shape(64, 4, 2, D)), torch.zeros(cache_shape(64, 4, 2, D))
    key, value, slots = torch.randn(3, 2, D), torch.randn(3, 2, D), torch.tensor([1, 6, 250])
    write_kv(expected, key, value, slots)
    compiled = torch.compile(write_kv_in_graph, fullgraph=True)
    _, code = run_and_get_code(compiled, cache, key, value, slots)
    assert torch.equal(cache, expected)
    assert "empty_strided_cpu(" not in "".join(code), "inductor allocated a buffer: the write is not in place"


def test_kv_partitions_cut_each_token_into_partitions_of_its_own_blocks():
    """Token ``t`` gets ``ceil(kv_lens[t] / (PARTITION_BLOCKS * bs))`` partitions of consecutive
    columns of its request's table row (columns past the table read its last one, masked), each with
    the keys it sees from its first one; each token's row of ``partitions`` lists its own, padded with
    its first; fewer than ``MIN_PARTITIONS`` in all are padded with dummies no token reads; ``rows``
    maps tokens to table rows; a table too narrow for the keys is refused."""
    bs = 2
    span = PARTITION_BLOCKS * bs  # 8 keys
    table = torch.arange(1, 31, dtype=torch.int32).view(3, 10)  # row r's blocks: 10r+1 .. 10r+10
    kv = kv_partitions(table, [17, 3, 8], bs)
    assert kv.num_partitions.tolist() == [3, 1, 1]
    assert kv.tokens.tolist() == [0, 0, 0, 1, 2]
    assert kv.kv_lens.tolist() == [17, 17 - span, 17 - 2 * span, 3, 8]
    assert kv.block_tables.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 10, 10], [11, 12, 13, 14],
                                        [21, 22, 23, 24]]
    assert kv.partitions.tolist() == [[0, 1, 2], [3, 3, 3], [4, 4, 4]]
    assert all(t.is_contiguous() and t.dtype == torch.long for t in vars(kv).values() if t is not None)

    by_rows = kv_partitions(table, [3, 9], bs, rows=[2, 0])  # token 0 reads row 2, token 1 row 0
    assert by_rows.block_tables.tolist() == [[21, 22, 23, 24], [1, 2, 3, 4], [5, 6, 7, 8]]
    assert by_rows.tokens.tolist() == [0, 1, 1] and by_rows.kv_lens.tolist() == [3, 9, 1]

    single = kv_partitions(torch.tensor([[5, 6]]), [3], bs)
    assert single.block_tables.tolist() == [[5, 6, 6, 6], [5, 6, 6, 6]] and single.kv_lens.tolist() == [3, 1]
    assert single.tokens.tolist() == [0, 0] and single.partitions.tolist() == [[0, 0]]
    assert single.num_partitions.tolist() == [1]
    with pytest.raises(ValueError, match="table"):
        kv_partitions(torch.tensor([[5, 6]]), [5], bs)


@pytest.mark.parametrize("paged_prefill", [True, False])
def test_conformance_with_window_softcap_sinks(paged_prefill):
    """The conformance suite's random mixed batches on layers with a sliding window (5, with 4-token
    blocks), a softcap, sinks and all three: the in-place kernel for every token (``paged_prefill``),
    or the kernel for decodes and the reference (HDN layout) for chunks."""
    check_attention_backend(TorchPagedAttentionBackend, compile=False, min_paged_decodes=1, paged_prefill=paged_prefill)


def test_window_never_reads_blocks_before_it():
    """Blocks whose every key is outside the query's window may hold another request's K/V (the
    KV-memory manager may reuse them): filled with large garbage, the output still equals attention
    over the window — the kernel starts each token's partitions at its window's first block, the
    reference masks by position. (Garbage must be finite: masked keys still meet a zero weight, e.g.
    in padding columns of the block table.)"""
    window, bs, kvh, heads = 5, 4, 2, 4
    layers = [AttentionLayerSpec(heads, kvh, D, D, sliding_window=window)]
    spec, tables = [(29, 1), (20, 6)], [list(range(8)), list(range(8, 15))]
    slots = [tables[i][p // bs] * bs + p % bs for i, (c, q) in enumerate(spec) for p in range(c, c + q)]
    gen = torch.Generator().manual_seed(0)
    kv = [(torch.randn(c + q, kvh, D, generator=gen), torch.randn(c + q, kvh, D, generator=gen)) for c, q in spec]
    qs = torch.randn(sum(q for _, q in spec), heads, D, generator=gen)
    expected = torch.cat([reference_attention(qs[:1], *kv[0], 29, D ** -0.5, window),
                          reference_attention(qs[1:], *kv[1], 20, D ** -0.5, window)])
    for backend in (TorchPagedAttentionBackend(heads, kvh, D, D ** -0.5, bs, torch.float32, torch.device("cpu"),
                                               layers, compile=False, min_paged_decodes=1, paged_prefill=True),
                    TorchAttentionBackend(heads, kvh, D, D ** -0.5, bs, torch.float32, torch.device("cpu"), layers)):
        cache = torch.zeros(backend.get_kv_cache_shape(16))
        for (c, _), table, (k, v) in zip(spec, tables, kv):
            ctx = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)], dtype=torch.long)
            backend.write_kv(cache, k[:c], v[:c], ctx)
            for b in table[:(c - window + 1) // bs]:  # blocks wholly before the window of every query
                stale = torch.full((bs, kvh, D), 1e4)
                backend.write_kv(cache, stale, -stale, torch.arange(b * bs, (b + 1) * bs))
        new_k = torch.cat([k[c:] for (k, _), (c, _) in zip(kv, spec)])
        new_v = torch.cat([v[c:] for (_, v), (c, _) in zip(kv, spec)])
        meta = backend.build_metadata(_common(spec, tables, slots, bs))
        out = backend.forward(0, qs, new_k, new_v, cache, meta, sliding_window=window)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_traceable_forward_with_features_equals_forward():
    """The traced decode path (``engine.compile``) gets the window's own partitions, the softcap and
    the sinks: same output as ``forward`` on every kind of layer."""
    layers = conformance_layers(TorchPagedAttentionBackend, 6, 2, D)
    backend = TorchPagedAttentionBackend(6, 2, D, D ** -0.5, 4, torch.float32, torch.device("cpu"), layers,
                                         compile=False, min_paged_decodes=1)
    gen = torch.Generator().manual_seed(4)
    cache, q, k, v, step = _decode_step(backend, gen)
    inputs = backend.traceable_inputs(step)
    assert sorted(inputs.windows) == [WINDOW]
    sinks = torch.randn(6, generator=gen)
    for layer in layers:
        features = {k: v for k, v in (("sliding_window", layer.sliding_window), ("softcap", layer.softcap),
                                      ("sinks", sinks if layer.has_sinks else None)) if v is not None}
        expected = backend.forward(0, q, k, v, cache.clone(), step, **features)
        out = backend.traceable_forward(0, q, k, v, cache.clone(), inputs, **features)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
