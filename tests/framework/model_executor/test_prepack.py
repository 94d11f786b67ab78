"""``engine.prepack_linears``: oneDNN-prepacked CPU linears compute what ``nn.Linear`` computes, the
fused q/k/v and gate/up GEMMs compute what the separate projections compute, prepacking applies
only where ``auto`` says, keeps tied weights shared, and keeps transformers parity in float32: eagerly
here, compiled (with the opaque GEMM op) in ``test_compile.py``'s shared engine."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES, hf_greedy

from framework import LLM, SamplingParams
from framework.model_executor.prepack import (
    FusedGatedMLP,
    PrepackedLinear,
    onednn_has_kernels,
    prepack_linears,
    should_prepack,
    unfuse_gated_mlps,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn) on CPU")
HAS_BF16 = torch.backends.mkldnn.is_available() and onednn_has_kernels(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="oneDNN has no bf16 path on this CPU (AVX2 only: no "
                                "avx512bw/avx_ne_convert); dtype=auto runs bf16 checkpoints in float32 here")
BF16 = pytest.param(torch.bfloat16, marks=needs_bf16)
#: the 16-bit dtype the tests that are not about the dtype use: bf16 where oneDNN has kernels for it
HALF = torch.bfloat16 if HAS_BF16 else torch.float32


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_prepacked_linear_matches_linear(dtype, rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=True).to(dtype)
    x = torch.randn(2, rows, 96).to(dtype)
    with torch.inference_mode():
        ref, out = linear(x), PrepackedLinear(linear)(x)
    assert out.shape == ref.shape == (2, rows, 160) and out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)


def test_layout_row_hint_follows_the_weight_dtype(monkeypatch):
    """Layers pack float32 weights for 64 rows (oneDNN's one-row float32 layout ran 1.15-1.6x slower
    at 1 to 64 rows), other dtypes for one; the LM head's hint is given explicitly and wins."""
    hints = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, hint: hints.append(hint) or reorder(w, hint))
    PrepackedLinear(torch.nn.Linear(32, 48))
    PrepackedLinear(torch.nn.Linear(32, 48), batch_hint=1)
    if HAS_BF16:
        PrepackedLinear(torch.nn.Linear(32, 48).to(torch.bfloat16))
        PrepackedLinear(torch.nn.Linear(32, 48).to(torch.bfloat16), batch_hint=64)
    assert hints == [64, 1, 1, 64] if HAS_BF16 else [64, 1]


@pytest.mark.parametrize("bias", [True, False])
def test_compiled_one_row_is_a_traced_gemv(bias):
    """Compiled with one row, a prepacked linear is ``traced_gemv`` on the plain weight (no oneDNN call
    in the generated code) and computes what ``nn.Linear`` computes; two rows keep the prepacked GEMM."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias).to(HALF)
    layer = PrepackedLinear(linear)
    compiled = torch.compile(layer, dynamic=False)
    for rows, uses_onednn in ((1, False), (2, True)):
        x = torch.randn(rows, 96).to(HALF)
        with torch.inference_mode():
            out, code = run_and_get_code(compiled, x)
            ref = linear(x)
        # the opaque op, or (traced through, in some test orders) the oneDNN call it wraps
        calls_onednn = any(op in "".join(code) for op in ("prepacked_linear.default(", "mkldnn._linear_pointwise.default("))
        assert calls_onednn == uses_onednn
        assert out.shape == (rows, 160) and out.dtype == HALF
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_should_prepack_modes():
    cpu = torch.device("cpu")
    assert should_prepack("auto", cpu, torch.bfloat16) == onednn_has_kernels(torch.bfloat16)
    assert should_prepack("auto", cpu, torch.float16) == onednn_has_kernels(torch.float16)
    assert should_prepack("auto", cpu, torch.float32)  # as vLLM's CPU backend (oneDNN for float32 too)
    assert not should_prepack("auto", cpu, torch.bfloat16, compile_freezing=True)  # inductor packs its own
    assert should_prepack("on", cpu, torch.float32)
    assert not should_prepack("off", cpu, torch.bfloat16)
    assert not should_prepack("auto", torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="prepack_linears"):
        should_prepack("always", cpu, torch.bfloat16)


def test_a_dtype_onednn_cannot_run_here_keeps_aten_linears_and_says_why(monkeypatch, caplog):
    """On an AVX2-only CPU oneDNN refuses bf16 weights: ``auto`` then keeps ATen's linears (logged with the
    CPU's flags), ``on`` warns; float32 is still prepacked."""
    from framework.model_executor import prepack

    monkeypatch.setattr(prepack, "onednn_has_kernels", lambda dtype: dtype == torch.float32)
    cpu = torch.device("cpu")
    with caplog.at_level("INFO", logger="framework.model_executor.prepack"):
        assert not should_prepack("auto", cpu, torch.bfloat16)
        assert not should_prepack("on", cpu, torch.float16)
        assert should_prepack("auto", cpu, torch.float32)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in said] == ["INFO", "WARNING"]
    assert all("keep ATen's kernels: oneDNN has no" in message for _, message in said)


def test_bad_mode_is_refused_before_loading():
    with pytest.raises(ValueError, match="prepack_linears must be auto, on or off"):
        LLM(model=STORIES, prepack_linears="yes")


def test_tied_lm_head_keeps_sharing_the_embedding():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=HALF)
    n = prepack_linears(model)
    assert n == 5 * 4 + 1  # fused qkv, o, fused gate_up, down per layer + the LM head
    assert isinstance(model.lm_head, PrepackedLinear)
    assert model.lm_head.weight is model.get_input_embeddings().weight


@needs_bf16
def test_engine_auto_prepacks_bf16_and_matches_unpacked_logits():
    """bf16 engine: linears are prepacked by default and the forward's logits equal the unpacked
    engine's within bf16 rounding; greedy text agrees on these prompts."""
    packed = LLM(model=STORIES, dtype="bfloat16")
    plain = LLM(model=STORIES, dtype="bfloat16", prepack_linears="off")
    assert isinstance(packed.engine.runner.model.lm_head, PrepackedLinear)
    assert type(plain.engine.runner.model.lm_head) is torch.nn.Linear
    ids = torch.tensor([[1, 403, 407, 261, 378, 285, 308, 264]])
    with torch.inference_mode():
        a = packed.engine.runner.model.model.embed_tokens(ids)
        for layer in (packed.engine.runner.model.lm_head, plain.engine.runner.model.lm_head):
            assert layer(a[0]).shape == (8, 512)
        diff = (packed.engine.runner.model.lm_head(a[0]).float() - plain.engine.runner.model.lm_head(a[0]).float()).abs()
    assert diff.max() < 0.1
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = ["Once upon a time", "The dog ran to the park and"]
    assert ([o.outputs[0].token_ids for o in packed.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])


def test_float32_on_keeps_transformers_parity():
    """``prepack_linears=on`` in float32: still token-identical to transformers greedy."""
    llm = LLM(model=STORIES, prepack_linears="on")
    assert isinstance(llm.engine.runner.model.lm_head, PrepackedLinear)
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in ["Once upon a time", "Max had a toy car", "There was a cat."]]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 32)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("compiled", [False, True])
def test_fused_projections_compute_the_unfused_model(dtype, compiled):
    """The fused q/k/v attention and gate/up MLP (eager; q/k/v only for ``compiled``) give the
    unfused model's logits through transformers' own forward (SDPA attention, no servelab code)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    ref = AutoModelForCausalLM.from_pretrained(STORIES, dtype=dtype, attn_implementation="sdpa")
    fused = AutoModelForCausalLM.from_pretrained(STORIES, dtype=dtype, attn_implementation="sdpa")
    prepack_linears(fused, compiled=compiled)
    layer = fused.model.layers[0]
    assert type(layer.self_attn) is not LlamaAttention and isinstance(layer.self_attn.qkv_proj, PrepackedLinear)
    assert not hasattr(layer.self_attn, "q_proj")
    assert isinstance(layer.mlp, LlamaMLP if compiled else FusedGatedMLP)
    ids = torch.tensor([[1, 403, 407, 261, 378, 285, 308, 264, 99, 7]])
    with torch.inference_mode():
        a, b = ref(ids).logits.float(), fused(ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 0.15
    assert (a - b).abs().max() < tol
    # engine.compile=auto compiles an eagerly prepacked model later: gate/up split again, still the reference
    assert unfuse_gated_mlps(fused) == (0 if compiled else len(fused.model.layers))
    if not compiled:
        assert layer.mlp.gate_up_proj is None and isinstance(layer.mlp.gate_proj, PrepackedLinear)
        with torch.inference_mode():
            assert (fused(ids).logits.float() - a).abs().max() < tol


def test_fused_linear_keeps_biases_and_refuses_mismatched_parts():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(32, 16, bias=True), torch.nn.Linear(32, 8, bias=False)]
    x = torch.randn(3, 32)
    with torch.inference_mode():
        out = PrepackedLinear.fused(parts)(x)
        ref = torch.cat([p(x) for p in parts], dim=-1)
    assert out.shape == (3, 24) and torch.allclose(out, ref, atol=1e-5)
    with pytest.raises(ValueError, match="in_features"):
        PrepackedLinear.fused([torch.nn.Linear(32, 16), torch.nn.Linear(24, 16)])
