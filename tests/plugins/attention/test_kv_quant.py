"""KV-cache quantization in the torch backend (engine.kv_cache_dtype=int8|fp8_e4m3): attention output
vs the unquantized backend on random mixed batches within stated tolerances, more blocks at a fixed
byte budget, greedy agreement, and refusal by backends that do not declare the dtype."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES

from framework.config import EngineConfig
from framework.core.sampling_params import SamplingParams
from framework.interfaces import CommonAttentionMetadata
from plugins.attention._kv_quant import quantize_rows
from plugins.attention.torch import TorchAttentionBackend

H, KVH, D, BS = 4, 2, 16, 4
# max |out - out_unquantized| on unit-normal q/k/v (outputs have magnitude ~0.3): int8 (7-bit mantissa
# equivalent, per token-head absmax) and fp8 e4m3 (3 mantissa bits, relative rounding error <= 1/16)
TOLERANCE = {torch.int8: 0.03, torch.float8_e4m3fn: 0.15}
SPECS = [[(5, 1), (0, 1), (12, 1), (0, 7), (9, 6), (3, 1 + BS * 2)], [(30, 1), (1, 1)], [(0, 13), (17, 5)]]


def _run(spec, kv_dtype, seed):
    """Same random batch through a backend with cache dtype ``kv_dtype`` (float32 = unquantized)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + q) // BS) for c, q in spec) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    backend = TorchAttentionBackend(H, KVH, D, D ** -0.5, BS, kv_dtype, torch.device("cpu"))
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks), dtype=backend.cache_dtype)
    tables, slots, qs, ks, vs = [], [], [], [], []
    for c, q in spec:
        table = [perm.pop() for _ in range(-(-(c + q) // BS))]
        tables.append(table)
        k_all, v_all = torch.randn(2, c + q, KVH, D, generator=gen)
        if backend.kv_quant is not None and c:
            k_ctx, v_ctx = quantize_rows(k_all[:c], kv_dtype), quantize_rows(v_all[:c], kv_dtype)
        else:
            k_ctx, v_ctx = k_all[:c], v_all[:c]
        for pos in range(c):
            cache[0, table[pos // BS], pos % BS] = k_ctx[pos]
            cache[1, table[pos // BS], pos % BS] = v_ctx[pos]
        slots += [table[p // BS] * BS + p % BS for p in range(c, c + q)]
        qs.append(torch.randn(q, H, D, generator=gen))
        ks.append(k_all[c:])
        vs.append(v_all[c:])
    q_lens, seq_lens = [q for _, q in spec], [c + q for c, q in spec]
    bt = torch.zeros(len(spec), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    nd = sum(1 for q in q_lens if q == 1)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in spec], dtype=torch.int32), block_table=bt,
        slot_mapping=torch.tensor(slots), query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, num_reqs=len(spec),
        num_tokens=sum(q_lens), num_decodes=nd, num_decode_tokens=nd, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=BS)
    return backend.forward(0, torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, backend.build_metadata(common))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_close_to_unquantized(kv_dtype, seed):
    for spec in SPECS:
        ref = _run(spec, torch.float32, seed)
        out = _run(spec, kv_dtype, seed)
        err = (out - ref).abs().max().item()
        assert err < TOLERANCE[kv_dtype], err
        assert err > 0  # really quantized


def test_block_bytes_and_blocks_at_fixed_budget():
    plain = TorchAttentionBackend(H, KVH, D, D ** -0.5, BS, torch.bfloat16, torch.device("cpu"))
    q8 = TorchAttentionBackend(H, KVH, D, D ** -0.5, BS, torch.int8, torch.device("cpu"))
    assert plain.kv_cache_bytes_per_block(3) == 3 * 2 * BS * KVH * D * 2
    assert q8.kv_cache_bytes_per_block(3) == 3 * 2 * BS * KVH * (D + 4)  # int8 values + float32 scale


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_engine_more_blocks_and_greedy_agreement(make_llm, kv_cache_dtype):
    """stories260K (head_dim 8): a block costs 12 bytes per token-head instead of 32, so the same budget
    holds 8/3 as many blocks. Greedy agreement with kv_cache_dtype=auto is reported, and int8 must agree on
    at least the first 8 tokens of every prompt."""
    budget = 1 << 20
    base = make_llm(kv_cache_memory_bytes=budget)
    quant = make_llm(kv_cache_memory_bytes=budget, kv_cache_dtype=kv_cache_dtype)
    assert quant.engine.kv_allocator.num_blocks == int(base.engine.kv_allocator.num_blocks * 32 / 12)
    assert quant.engine.metrics.summary()["kv_cache_num_blocks"] == quant.engine.kv_allocator.num_blocks
    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park and"]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params)]
    first_div = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r)) for r, g in zip(ref, got)]
    print(f"kv_cache_dtype={kv_cache_dtype}: first divergence per prompt {first_div} of 32")
    if kv_cache_dtype == "int8":
        assert min(first_div) >= 8, first_div


def test_backend_refuses_undeclared_kv_dtype():
    class AutoOnly(TorchAttentionBackend):
        name = "auto_only"
        supported_kv_cache_dtypes = ("auto",)

    problems = AutoOnly.validate(EngineConfig(model=STORIES, kv_cache_dtype="int8"))
    assert any("does not support kv_cache_dtype=int8" in p for p in problems)
    assert TorchAttentionBackend.validate(EngineConfig(model=STORIES, kv_cache_dtype="fp8_e4m3")) == []
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, int8 or fp8_e4m3"):
        EngineConfig(model=STORIES, kv_cache_dtype="int4")
