"""Multi-LoRA on families whose gated MLP the CPU path fuses (``gate_up_proj``: Qwen2, Gemma 2 with its softcaps and
sliding window): a mixed batch of three PEFT adapters and the base model, ``max_loras=2`` so slots swap, equals
``PeftModel``'s greedy tokens on each family's tiny random-weight model (float32)."""

from __future__ import annotations

import pytest
import torch
from families import tiny_model_dir
from lora_peft import NUM_TOKENS, base_model, make_adapters, peft

from framework import LLM, SamplingParams
from framework.model_executor.lora_layers import LoRAPart

PROMPT_IDS = [[5, 60, 87, 120, 33, 41, 9], [7, 300, 12, 250], [99, 100, 101, 102, 103, 104]]
NAMES = ["attn", None, "mlp", "all"]
pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # LoRA's subject is the linears: eager attention kernel


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_a_mixed_batch_on_fused_gated_mlps_equals_peft(family, tmp_path):
    path = str(tiny_model_dir(family))
    adapters = make_adapters(tmp_path, path)
    llm = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, num_blocks=128)
    layers = llm.engine.executor.worker.lora.layers.values()
    assert any(isinstance(layer, LoRAPart) for layer in layers), "the gated MLPs should be fused under LoRA"
    ids = [PROMPT_IDS[i % len(PROMPT_IDS)] for i in range(len(NAMES))]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                        lora_request=[adapters[n] if n else None for n in NAMES])
    for prompt, name, out in zip(ids, NAMES, outs):
        model = base_model(path)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, adapters[name].lora_path)
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                                      max_length=None)[0, len(prompt):].tolist()
        assert out.error is None and out.outputs[0].token_ids == expected, (family, name)
