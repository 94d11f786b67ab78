"""``triton`` tree attention (token-tree speculative decoding): the kernel's draft-tree mask against a float32
reference, then the engine: every tree node's logits equal a plain transformers forward over its root-to-node path,
and greedy output with Medusa and EAGLE-2 dynamic trees equals transformers token for token (float32, stories260K).

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, ``tests/conftest.py``); the backend itself
is CUDA-only, so the engine tests let it run on CPU for the test (``requires_cuda``, ``supported_devices`` patched). On a CUDA machine
(``gpu`` marker, ``bash scripts/gpu_check.sh``) the compiled kernel is checked the same way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import STORIES, STORIES_EAGLE, hf_greedy

from framework import LLM, SamplingParams
from framework.core.spec_tree import ancestor_mask
from plugins.attention import _triton_kernel
from plugins.attention.triton import TritonAttentionBackend

interpreted = pytest.mark.skipif(not _triton_kernel.interpreter_active(),
                                 reason="Triton's interpreter is off (TRITON_INTERPRET unset before triton's import)")


def _sibling(name: str):
    """A test module next to this one (``--import-mode=importlib`` puts only ``tests/`` on ``sys.path``)."""
    spec = importlib.util.spec_from_file_location(f"_triton_tree_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_long_batch = _sibling("test_triton")._long_batch
# the torch backends' node-logits check, run here with attention=triton (a name pytest does not collect again)
check_node_logits = _sibling("test_tree_attention").test_every_node_equals_a_plain_forward_over_its_path
MEDUSA = {"model": str(Path(STORIES).parent / "stories260K-medusa"),
          "tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]}
EAGLE = {"model": STORIES_EAGLE, "tree": "dynamic", "topk": 3, "num_speculative_tokens": 3, "num_draft_tokens": 8}


def _masked_reference(q, k, v, context_len, scale, visible):
    """Float32 attention of one request's ``q`` ``(Q, H, D)`` over ``k``/``v`` ``(context_len + Q, KVH, D)``: the
    context, then among its own query keys those ``visible`` ``(Q, Q)`` allows (GQA by repeating K/V)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    allow = torch.cat([torch.ones(q.shape[0], context_len, dtype=torch.bool), visible], 1)  # (Q, keys)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allow, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _check_kernel_tree_mask(num_heads, num_kv_heads, device="cpu"):
    """Three tree requests of different sizes (one wider than a 16-key tile, one crossing a tile boundary), a plain
    decode and a causal prefill chunk in one launch, against :func:`_masked_reference`."""
    parents = {0: [-1, -1, 0, 0, 1, 2, 4], 2: [-1, 0, -1], 4: [-1] * 5 + list(range(13))}  # per tree request
    spec = [(9, 2 + 7), (20, 1), (14, 1 + 3), (30, 6), (5, 1 + 18)]
    cache, block_table, seq_lens, qsl, reqs = _long_batch(spec, 5, num_heads, num_kv_heads, 8, seed=3)
    visible = {r: torch.from_numpy(ancestor_mask(p, num_real=spec[r][1] - len(p))) for r, p in parents.items()}
    rows, mask = _triton_kernel.pack_tree_mask(len(spec), list(visible), list(visible.values()), torch.device(device))
    query = torch.cat([q for q, _, _, _ in reqs]).to(device)
    cache, block_table, seq_lens, qsl = (t.to(device) for t in (cache, block_table, seq_lens, qsl))
    out = _triton_kernel.unified_attention(torch.empty_like(query), query, cache[0], cache[1], block_table, seq_lens,
                                           qsl, 8 ** -0.5, tree_rows=rows, tree_mask=mask)
    expected = []
    for r, (q, k, v, c) in enumerate(reqs):
        causal = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
        expected.append(_masked_reference(q, k, v, c, 8 ** -0.5, visible.get(r, causal)))
    torch.testing.assert_close(out.cpu(), torch.cat(expected), rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (6, 2)])
def test_kernel_tree_mask_against_reference(monkeypatch, num_heads, num_kv_heads):
    """GQA groups 2 and 3 (a spare row per program), 16-key tiles."""
    monkeypatch.setattr(_triton_kernel, "TILE_SIZE", 16)
    _check_kernel_tree_mask(num_heads, num_kv_heads)


def test_tree_rows_and_mask_go_together():
    q = torch.zeros(1, 2, 8)
    cache = torch.zeros(1, 4, 2, 8)
    one = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="pack_tree_mask"):
        _triton_kernel.unified_attention(torch.empty_like(q), q, cache, cache, one[None] * 0, one,
                                         torch.tensor([0, 1], dtype=torch.int32), 1.0, tree_rows=one)


def test_pack_tree_mask_layout():
    a, b = torch.ones(3, 3, dtype=torch.bool).tril(), torch.eye(2, dtype=torch.bool)
    rows, mask = _triton_kernel.pack_tree_mask(4, [1, 3], [a, b], torch.device("cpu"))
    assert rows.tolist() == [-1, 0, -1, 3] and mask.dtype == torch.int8
    assert mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 1, 0]]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The CUDA-only backend allowed on CPU for the test: its kernel runs in Triton's interpreter."""
    if not _triton_kernel.interpreter_active() and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET unset before triton's import)")
    monkeypatch.setattr(TritonAttentionBackend, "supported_devices", ("cpu", "cuda"))
    monkeypatch.setattr(TritonAttentionBackend, "requires_cuda", False)


def test_every_node_equals_a_plain_forward_over_its_path(triton_on_cpu):
    """The torch backends' node-logits test (``test_tree_attention.py``: three requests with trees of different
    sizes and a plain decode in one verify step) with ``attention=triton``."""
    check_node_logits("triton", {})


@pytest.mark.slow  # Triton's interpreter: seconds of CPU per verify step
@pytest.mark.parametrize("params", [MEDUSA, EAGLE], ids=["medusa", "eagle-dynamic"])
def test_greedy_tree_output_equals_transformers(triton_on_cpu, make_llm, params):
    """Two requests' trees in each verify launch; 8 tokens are a prefill and 3-5 verify steps (the interpreter runs
    each program instance in Python: steps are what cost)."""
    drafter = "medusa" if params is MEDUSA else "eagle"
    llm = make_llm(drafter=drafter, drafter_params=params, attention="triton", dtype="float32", grammar="none",
                   enforce_eager=True)
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in ["Once upon a time", "Max had a toy car and"]]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 8)
    summary = llm.engine.metrics.summary()
    assert summary["spec_num_accepted_tokens"] > 0 and summary["spec_mean_accepted_length"] > 1.0


# ---- on a CUDA machine ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("tile", [16, 32])
def test_gpu_kernel_tree_mask_against_reference(monkeypatch, tile):
    monkeypatch.setattr(_triton_kernel, "TILE_SIZE", tile)
    _check_kernel_tree_mask(8, 2, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("params", [MEDUSA, EAGLE], ids=["medusa", "eagle-dynamic"])
def test_gpu_greedy_tree_output_equals_transformers(params):
    """Compiled kernel: greedy float32 output with tree drafters equals transformers (``scripts/gpu_check.sh``)."""
    llm = LLM(model=STORIES, device="cuda", drafter="medusa" if params is MEDUSA else "eagle", drafter_params=params,
              attention="triton", dtype="float32", grammar="none", enforce_eager=True)
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in ["Once upon a time", "Max had a toy car and", "The dog ran to the park"]]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 32)
    assert llm.engine.metrics.summary()["spec_num_accepted_tokens"] > 0
