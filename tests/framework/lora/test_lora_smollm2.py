"""Multi-LoRA on the default real model, SmolLM2-135M-Instruct (float32, greedy), PEFT's ``PeftModel`` as the oracle:
the three adapters of ``tests/lora_peft.py`` (ranks 4, 8, 2, different targets, one rsLoRA) made for SmolLM2 (GQA
9:3, 30 layers), a mixed batch of them and the base model through ``max_loras=2`` slots, one engine build. Slow:
SmolLM2 in float32 on a small CPU, so few prompts and tokens.
"""

from __future__ import annotations

import pytest
import torch
from lora_peft import base_model, make_adapters, peft

from framework import LLM, SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]
PROMPTS = ["The capital of France is", "Write a haiku about the sea."]
NAMES = ["attn", None, "mlp", "all", "mlp"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    from framework.model_executor.model_loader import resolve_model_path

    return resolve_model_path("smollm2")


def _peft_greedy(path: str, adapter: str | None, ids: list[int]) -> list[int]:
    model = base_model(path)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                             max_length=None)
    return out[0, len(ids):].tolist()


def test_a_mixed_batch_on_smollm2_equals_peft(smollm2_path, tmp_path):
    adapters = make_adapters(tmp_path, smollm2_path)
    llm = LLM(smollm2_path, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3,
              max_model_len=256, num_blocks=64)
    tokenizer = llm.get_tokenizer()
    ids = [tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(len(NAMES))]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                        lora_request=[adapters[n] if n else None for n in NAMES])
    expected = {}
    for prompt_ids, name, out in zip(ids, NAMES, outs):
        assert out.error is None, out.error
        key = (tuple(prompt_ids), name)
        if key not in expected:
            expected[key] = _peft_greedy(smollm2_path, adapters[name].lora_path if name else None, prompt_ids)
        assert out.outputs[0].token_ids == expected[key], (name, prompt_ids)
    assert outs[3].outputs[0].token_ids != outs[1].outputs[0].token_ids, "the adapter changed nothing: no check"
    assert llm.engine.executor.worker.lora.stats()["num_slot_swaps"] >= 3
