"""``engine.prepack_linears``: oneDNN-prepacked CPU linears compute what ``nn.Linear`` computes, apply
only where ``auto`` says, keep tied weights shared, and leave the float32 parity path alone."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES, hf_greedy

from framework import LLM, SamplingParams
from framework.prepack import PrepackedLinear, prepack_linears, should_prepack

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn) on CPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
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


def test_should_prepack_modes():
    cpu = torch.device("cpu")
    assert should_prepack("auto", cpu, torch.bfloat16, compile=False)
    assert not should_prepack("auto", cpu, torch.float32, compile=False)  # the parity reference path
    assert not should_prepack("auto", cpu, torch.bfloat16, compile=True)  # inductor owns the linears
    assert should_prepack("on", cpu, torch.float32, compile=False)
    assert not should_prepack("off", cpu, torch.bfloat16, compile=False)
    assert not should_prepack("auto", torch.device("cuda"), torch.bfloat16, compile=False)
    with pytest.raises(ValueError, match="prepack_linears"):
        should_prepack("always", cpu, torch.bfloat16, compile=False)


def test_bad_mode_is_refused_before_loading():
    with pytest.raises(ValueError, match="prepack_linears must be auto, on or off"):
        LLM(model=STORIES, prepack_linears="yes")


def test_tied_lm_head_keeps_sharing_the_embedding():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16)
    n = prepack_linears(model)
    assert n == 5 * 7 + 1  # q, k, v, o, gate, up, down per layer + the LM head
    assert isinstance(model.lm_head, PrepackedLinear)
    assert model.lm_head.weight is model.get_input_embeddings().weight


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
