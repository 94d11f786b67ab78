"""``triton`` attention: the unified Triton kernel against the float32 reference, on CPU through Triton's
interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` on machines without CUDA).

Random mixed batches (decodes first, then fresh prefills and chunks with cached context), blocks
scattered through the pool, block sizes 1/3/4/16 (3: not a power of two), GQA groups 1/2/3/8, head
sizes that need padding to a power of two, and every layer feature (window, softcap, sinks, all
three). Long contexts with a small tile cover the multi-tile loop and the window's skipped tiles.
On a CUDA machine (``gpu`` marker) the compiled kernel is checked the same way, and float32 greedy
output equals transformers'.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import STORIES

from framework.testing.attention import check_attention_backend, reference_attention
from plugins.attention import _triton_kernel
from plugins.attention.triton import TritonAttentionBackend

interpreted = pytest.mark.skipif(not _triton_kernel.interpreter_active(),
                                 reason="Triton's interpreter is off (TRITON_INTERPRET unset before triton's import)")


@interpreted
@pytest.mark.parametrize("block_size, num_heads, num_kv_heads, head_size",
                         [(1, 4, 2, 8), (3, 6, 2, 12), (4, 8, 1, 8), (16, 3, 3, 16)])
def test_conformance_on_random_mixed_batches(block_size, num_heads, num_kv_heads, head_size):
    check_attention_backend(TritonAttentionBackend, num_batches=4, seed=block_size, block_size=block_size,
                            num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, atol=1e-5)


@interpreted
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_conformance_half_precision(dtype, atol):
    check_attention_backend(TritonAttentionBackend, num_batches=3, seed=7, dtype=dtype, atol=atol)


def _long_batch(spec, block_size, num_heads, num_kv_heads, head_size, seed=0):
    """A batch of ``spec = [(context_len, query_len), ...]`` in a scattered pool (NHD pages): the kernel's
    arguments and each request's q/k/v for the reference."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in spec) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    tables, reqs = [], []
    for c, q in spec:
        table = [free.pop() for _ in range(-(-(c + q) // block_size))]
        k, v = (torch.randn(c + q, num_kv_heads, head_size, generator=gen) for _ in range(2))
        for p in range(c + q):
            cache[0, table[p // block_size], p % block_size], cache[1, table[p // block_size], p % block_size] = k[p], v[p]
        tables.append(table)
        reqs.append((torch.randn(q, num_heads, head_size, generator=gen), k, v, c))
    block_table = torch.zeros(len(spec), max(map(len, tables)) + 1, dtype=torch.int32)  # a spare column
    for i, table in enumerate(tables):
        block_table[i, :len(table)] = torch.tensor(table)
    q_lens = torch.tensor([q for _, q in spec])
    query_start_loc = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in spec], dtype=torch.int32)
    return cache, block_table, seq_lens, query_start_loc, reqs


@interpreted
@pytest.mark.parametrize("window, softcap, sinks", [(None, None, False), (5, None, False), (17, 2.0, True)])
def test_long_contexts_cross_many_tiles(monkeypatch, window, softcap, sinks):
    """Contexts of 40-70 keys with 16-key tiles: the online softmax over several tiles, several query
    blocks per prefill, and a window that skips whole tiles before it."""
    monkeypatch.setattr(_triton_kernel, "TILE_SIZE", 16)
    spec, num_heads, num_kv_heads, head_size = [(70, 1), (33, 1), (0, 45), (40, 30)], 4, 2, 8
    cache, block_table, seq_lens, qsl, reqs = _long_batch(spec, 5, num_heads, num_kv_heads, head_size)
    sink = torch.randn(num_heads) if sinks else None
    query = torch.cat([q for q, _, _, _ in reqs])
    out = _triton_kernel.unified_attention(torch.empty_like(query), query, cache[0], cache[1], block_table, seq_lens,
                                           qsl, head_size ** -0.5, sliding_window=window, softcap=softcap, sinks=sink)
    expected = torch.cat([reference_attention(q, k, v, c, head_size ** -0.5, window, softcap, sink)
                          for q, k, v, c in reqs])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_a_program_writes_only_its_own_query_block(monkeypatch):
    """GQA group 3: a program's 16 rows hold 5 tokens x 3 heads; its spare row must not store token 5,
    the next program's (on a GPU the next program may finish first). Only program 0 runs here."""
    real = _triton_kernel.unified_attention_kernel

    class FirstProgramOnly:
        def __getitem__(self, grid):
            return real[(1, grid[1])]

    monkeypatch.setattr(_triton_kernel, "unified_attention_kernel", FirstProgramOnly())
    monkeypatch.setattr(_triton_kernel, "interpreter_active", lambda: True)
    assert _triton_kernel.launch_shape(6, 2, 8)["BLOCK_Q"] == 5
    cache, block_table, seq_lens, qsl, reqs = _long_batch([(3, 8)], 4, 6, 2, 8)
    query = reqs[0][0]
    out = _triton_kernel.unified_attention(torch.full_like(query, float("nan")), query, cache[0], cache[1],
                                           block_table, seq_lens, qsl, 8 ** -0.5)
    expected = reference_attention(*reqs[0][:3], 3, 8 ** -0.5)
    torch.testing.assert_close(out[:5], expected[:5], rtol=1e-5, atol=1e-5)
    assert out[5:].isnan().all()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(_triton_kernel, "interpreter_active", lambda: False)
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(1, 4, 2, 8)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _triton_kernel.unified_attention(torch.empty_like(q), q, cache, cache, one[None] * 0, one,
                                         torch.tensor([0, 1], dtype=torch.int32), 1.0)


def test_metadata_is_the_runners_device_tensors():
    """What CUDA-graph capture relies on: no copies, no host values."""
    from attention_harness import common_metadata

    common = common_metadata([(3, 1), (0, 4)], [[2], [0, 1]], [11, 0, 1, 2, 3], 4, torch.device("cpu"))
    backend = TritonAttentionBackend(4, 2, 8, 8 ** -0.5, 4, torch.float32, torch.device("cpu"))
    meta = backend.build_metadata(common)
    assert meta.block_table is common.block_table and meta.seq_lens is common.seq_lens
    assert meta.query_start_loc is common.query_start_loc and meta.slot_mapping is common.slot_mapping
    assert TritonAttentionBackend.supports_cuda_graphs


# ---- on a CUDA machine ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 48])
def test_gpu_conformance_float32(block_size):
    check_attention_backend(TritonAttentionBackend, num_batches=10, seed=block_size, device="cuda",
                            block_size=block_size, num_heads=8, num_kv_heads=2, head_size=64, atol=1e-4)


@pytest.mark.gpu
def test_gpu_greedy_equals_transformers_float32():
    from helpers import hf_greedy

    from framework import LLM, SamplingParams

    llm = LLM(model=STORIES, attention="triton", device="cuda", dtype="float32", block_size=4,
              long_prefill_token_threshold=5, enforce_eager=True, grammar="none")
    prompts = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, prompts, 24)
