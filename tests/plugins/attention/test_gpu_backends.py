"""GPU attention backends (flash_attn, flashinfer, xformers, hybrid).

On CPU: the metadata builders (cu_seqlens, FlashInfer indptr/indices/last_page_len, gather
indices, decode/prefill split) are checked against hand-computed arrays; every GPU backend is
refused before weights load with an error naming the fix; ``hybrid`` over two CPU backends matches
naive attention and transformers. With CUDA (``gpu`` marker): each backend whose package is installed matches the
reference on random mixed batches and keeps the write-before-read contract (engine-level checks:
``tests/test_gpu_e2e.py``).
"""

from __future__ import annotations

import pytest
import torch
from attention_harness import common_metadata, run_random_batch, run_same_step_prefix_hit
from helpers import STORIES

from framework import EngineConfig, registry
from framework.engine.builder import validate_plugins
from framework.interfaces import AttentionLayerSpec
from plugins.attention._paged_metadata import (
    cu_seqlens,
    gather_context_index,
    paged_kv_indices,
    split_decode_prefill,
)
from plugins.attention.flash_attn import build_flash_attn_metadata
from plugins.attention.flashinfer import build_flashinfer_plan
from plugins.attention.xformers import build_xformers_metadata

GPU_BACKENDS = ("flash_attn", "flashinfer", "xformers", "triton")
# (context_len, query_len): two decodes, a fresh prefill, a chunk with cached context
SPEC = [(5, 1), (9, 1), (0, 6), (7, 3)]
TABLES = [[3, 1], [0, 4, 9], [2, 5], [6, 7, 8]]
BS = 4


def _common():
    slots = []
    for (c, q), table in zip(SPEC, TABLES):
        slots += [table[p // BS] * BS + p % BS for p in range(c, c + q)]
    return common_metadata(SPEC, TABLES, slots, BS, torch.device("cpu"))


def test_cu_seqlens():
    assert cu_seqlens(torch.tensor([3, 1, 4])).tolist() == [0, 3, 4, 8]
    assert cu_seqlens(torch.tensor([], dtype=torch.int64)).tolist() == [0]


def test_paged_kv_indices_match_hand_computed():
    p = paged_kv_indices(torch.tensor([[3, 1, 0], [0, 4, 9], [2, 5, 0]]), torch.tensor([6, 10, 4]), BS)
    assert p.indptr.tolist() == [0, 2, 5, 6]
    assert p.indices.tolist() == [3, 1, 0, 4, 9, 2]
    assert p.last_page_len.tolist() == [2, 2, 4]
    assert p.indptr.dtype == p.indices.dtype == p.last_page_len.dtype == torch.int32


def test_paged_kv_indices_rejects_short_table():
    with pytest.raises(ValueError, match="needs 3 blocks"):
        paged_kv_indices(torch.tensor([[1, 2]]), torch.tensor([9]), BS)


def test_split_decode_prefill_rebases_prefill_part():
    decode, prefill = split_decode_prefill(_common())
    assert decode.num_reqs == 2 and decode.num_tokens == 2 and decode.seq_lens.tolist() == [6, 10]
    assert prefill.num_reqs == 2 and prefill.num_decodes == 0
    assert prefill.query_start_loc.tolist() == [0, 6, 9]
    assert prefill.slot_mapping.tolist() == _common().slot_mapping[2:].tolist()
    assert prefill.max_query_len == 6 and prefill.max_seq_len == 10


def test_gather_context_index():
    idx = gather_context_index(torch.tensor([[3, 1], [2, 5]]), [6, 5], BS)
    assert idx.tolist() == [12, 13, 14, 15, 4, 5] + [8, 9, 10, 11, 20]


def test_flash_attn_metadata():
    m = build_flash_attn_metadata(_common())
    assert m.num_decode_tokens == 2
    assert m.decode_seq_lens.tolist() == [6, 10] and m.decode_block_table.shape[0] == 2
    assert m.cu_seqlens_q.tolist() == [0, 6, 9] and m.cu_seqlens_k.tolist() == [0, 6, 16]
    assert (m.max_seqlen_q, m.max_seqlen_k) == (6, 10)
    assert m.prefill_block_table.tolist() == [[2, 5, 0], [6, 7, 8]]


def test_flashinfer_plan():
    plan = build_flashinfer_plan(_common())
    assert plan.decode.indptr.tolist() == [0, 2, 5] and plan.decode.indices.tolist() == [3, 1, 0, 4, 9]
    assert plan.decode.last_page_len.tolist() == [2, 2]
    assert plan.prefill.indptr.tolist() == [0, 2, 5] and plan.prefill.indices.tolist() == [2, 5, 6, 7, 8]
    assert plan.prefill.last_page_len.tolist() == [2, 2]
    assert plan.prefill_qo_indptr.tolist() == [0, 6, 9]


def test_flashinfer_replans_wrappers_shared_by_kv_cache_groups(monkeypatch):
    """With KV cache groups each group has its own plan (its own pages): a layer group's wrappers planned
    by one KV cache group's plan are planned again when a layer of another group uses them, and not again
    while the same plan's layers follow. FlashInfer is faked (CPU): only the planning logic runs."""
    import sys
    import types

    plans = []

    class Wrapper:
        def __init__(self, *args):
            pass

        def plan(self, *args, **kwargs):
            plans.append(args[1] if len(args) > 1 else None)

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=Wrapper, BatchPrefillWithPagedKVCacheWrapper=Wrapper))
    from plugins.attention.flashinfer import FlashInferBackend

    backend = FlashInferBackend(4, 2, 64, 0.125, BS, torch.bfloat16, torch.device("cpu"))
    first, second = build_flashinfer_plan(_common()), build_flashinfer_plan(_common())
    group = backend._group(None, 7, None)
    for plan in (first, first, second, second, first):
        backend._plan(plan, group)
    assert len(plans) == 3 * 2  # first, second, first again: decode + prefill wrappers each time


def test_xformers_metadata():
    m = build_xformers_metadata(_common())
    assert m.q_seqlen == [1, 1, 6, 3] and m.kv_seqlen == [6, 10, 6, 10]
    assert m.context_index.numel() == sum(m.kv_seqlen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend_refused_on_cpu_before_loading(name):
    with pytest.raises(ValueError, match="needs a CUDA GPU") as e:
        validate_plugins(EngineConfig(model=STORIES, attention=name))
    assert "attention=torch" in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_hybrid_with_gpu_part_refused_on_cpu():
    with pytest.raises(ValueError, match="flash_attn"):
        validate_plugins(EngineConfig(model=STORIES, attention="hybrid", attention_params={"prefill": "flash_attn"}))


def test_flash_attn_block_size_rule_is_declared():
    problems = registry.get_class("attention", "flash_attn").validate(
        EngineConfig(model=STORIES, attention="flash_attn", device="cpu", dtype="bfloat16"))
    assert any("multiple of 256" in p for p in problems)


def test_head_size_checked_before_weights_load():
    # stories260K has head_size 8; FlashInfer's kernels are compiled for 64/128/256
    problems = registry.get_class("attention", "flashinfer").validate_model([AttentionLayerSpec(8, 4, 8, 8)])
    assert problems and "head_size=8" in problems[0]


def test_hybrid_refuses_nesting():
    problems = registry.get_class("attention", "hybrid").validate(
        EngineConfig(model=STORIES, attention="hybrid", attention_params={"decode": "hybrid"}))
    assert any("cannot nest" in p for p in problems)


def _hybrid(block_size: int, dtype=torch.float32, device="cpu", prefill="torch", decode="torch"):
    return registry.create("attention", "hybrid", num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5,
                           block_size=block_size, dtype=dtype, device=torch.device(device), prefill=prefill,
                           decode=decode, decode_params={"decode_kernel": "gqa"})


@pytest.mark.parametrize("spec", [SPEC, [(3, 1)], [(0, 5), (4, 4)]])
def test_hybrid_over_cpu_backends_matches_naive(spec):
    out, expected = run_random_batch(_hybrid, spec)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_hybrid_of_torch_paged_keeps_its_layout():
    """Both parts ``torch_paged`` (transposed key blocks): hybrid's write-everything-first uses the
    shared layout's ``write_kv``, so cached context keys are not overwritten (an NHD write into the
    transposed blocks was), and the output matches the naive reference."""
    def make(bs):
        return registry.create("attention", "hybrid", num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5,
                               block_size=bs, dtype=torch.float32, device=torch.device("cpu"), prefill="torch_paged",
                               decode="torch_paged", prefill_params={"compile": False},
                               decode_params={"compile": False, "min_paged_decodes": 1})
    assert make(4).kv_cache_layout == "HDN"
    out, expected = run_random_batch(make, SPEC)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["torch", "hybrid"])
def test_write_before_read_contract_cpu(name):
    def make(bs):
        if name == "hybrid":
            return _hybrid(bs)
        return registry.create("attention", name, num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5,
                               block_size=bs, dtype=torch.float32, device=torch.device("cpu"))
    out, expected = run_same_step_prefix_hit(make)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_hybrid_engine_greedy_equals_transformers():
    from helpers import hf_greedy

    from framework import LLM, SamplingParams

    llm = LLM(model=STORIES, attention="hybrid", attention_params={"prefill": "torch", "decode": "torch"},
              block_size=4, long_prefill_token_threshold=5)
    prompts = [[1, 403, 407, 261, 378], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, prompts, 24)


# ---- on a CUDA machine ---------------------------------------------------------------------------
#: the package each GPU backend needs (scripts/gpu_check.sh: only triton's is on the lent GPU machine)
PACKAGES = {"flash_attn": "flash_attn", "flashinfer": "flashinfer", "xformers": "xformers", "triton": "triton"}


def _gpu_backend(name: str, dtype: torch.dtype):
    pytest.importorskip(PACKAGES[name], reason=f"attention={name}: its package is not installed here")

    def make(block_size: int):
        return registry.create("attention", name, num_heads=8, num_kv_heads=2, head_size=64, scale=64 ** -0.5,
                               block_size=block_size, dtype=dtype, device=torch.device("cuda"))
    return make


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_backend_matches_reference(name, dtype):
    block_size = 256 if name == "flash_attn" else 16
    spec = [(300, 1), (17, 1), (0, 40), (290, 33), (5, 700)]
    out, expected = run_random_batch(_gpu_backend(name, dtype), spec, num_heads=8, num_kv_heads=2, head_size=64,
                                     block_size=block_size, dtype=dtype, device="cuda")
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_gpu_backend_write_before_read(name):
    block_size = 256 if name == "flash_attn" else 16
    make = _gpu_backend(name, torch.float16)
    out, expected = run_same_step_prefix_hit(make, dtype=torch.float16, device="cuda", block_size=block_size,
                                             num_heads=8, num_kv_heads=2, head_size=64)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
