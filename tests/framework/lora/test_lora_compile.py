"""Multi-LoRA under ``engine.compile=true`` (stories260K, float32, greedy): the LoRA term is the opaque op
``servelab::lora`` inside the compiled layer graphs, so adapters swapping through ``max_loras=2`` slots (three
adapters) and steps of different adapter counts equal PEFT token for token and compile nothing after the warm-up.
``compile_backend=eager`` keeps it fast: dynamo's tracing, guards and graph counts are inductor's (the same test
with ``compile_backend="inductor"`` passes too, in ~30 s on 2 cores)."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES
from lora_peft import NUM_TOKENS, PROMPTS

from framework import LLM, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_compiled_lora_equals_peft_without_recompiles(adapters, oracle):
    llm = LLM(STORIES, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=2,
              num_blocks=128, compile=True, compile_backend="eager")
    stats = llm.engine.runner.compile_stats
    assert stats.active, stats.fallback_reason
    sp = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0)
    # one adapter at a time, then mixed batches of two adapters and the base: slots swap between steps
    rounds = [["attn"], ["mlp"], ["all"], ["attn", None, "mlp"], ["all", "attn", None], [None]]
    for names in rounds:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        outs = llm.generate(prompts, sp, lora_request=[adapters[n] if n else None for n in names])
        for prompt, name, out in zip(prompts, names, outs):
            assert out.error is None and out.outputs[0].token_ids == oracle(prompt, name), (prompt, name)
    assert llm.engine.executor.worker.lora.stats()["num_slot_swaps"] >= 4
    assert stats.num_recompiles == 0 and stats.num_graphs == stats.num_graphs_warmup


def test_the_lora_op_contract():
    """``servelab::lora`` passes ``torch.library.opcheck`` (schema, fake shapes, AOT dispatch) inside a LoRA step,
    equals ``y + scale * x A^T B^T`` for the tokens with a slot, and adds nothing outside a step."""
    from framework import registry
    from framework.model_executor.forward_context import ForwardContext, forward_context
    from framework.model_executor.lora_layers import LoRAStep, lora_op

    torch.manual_seed(0)
    y, x = torch.randn(3, 5), torch.randn(3, 4)
    a, b = torch.randn(2, 2, 4), torch.randn(2, 5, 2)
    out = lora_op(y, x, a, b, [b.shape[1]])
    assert torch.equal(out, y) and out.data_ptr() != y.data_ptr()
    backend = registry.create("lora_backend", "bgmv")
    scales = torch.tensor([0.5, 2.0])
    step = LoRAStep(backend, backend.prepare(torch.tensor([1, -1, 0])), scales)
    with forward_context(ForwardContext(None, None, [], lora=step)):
        torch.library.opcheck(lora_op, (y, x, a, b, [b.shape[1]]))
        out = lora_op(y, x, a, b, [b.shape[1]])
    expected = y.clone()
    for token, slot in ((0, 1), (2, 0)):
        expected[token] += scales[slot] * (x[token] @ a[slot].T @ b[slot].T)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
