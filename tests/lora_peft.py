"""PEFT adapters and PEFT's greedy tokens on stories260K, shared by the multi-LoRA tests (``tests/framework/lora/``):
three adapters of different ranks and targets (one rsLoRA), made with PEFT at test time, and a memoized
``PeftModel`` oracle. Import the fixtures into a test module (``from lora_peft import adapters, oracle``)."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES

from framework import LoRARequest

peft = pytest.importorskip("peft")
NUM_TOKENS = 6
PROMPTS = ["Once upon a time", "The cat sat on", "Lily went to the park"]
# name -> (rank, lora_alpha, targets, use_rslora)
SPECS = {"attn": (4, 16, ["q_proj", "v_proj"], False),
         "mlp": (8, 16, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
         "all": (2, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False)}


def base_model(path: str = STORIES):
    """The model at ``path`` (default stories260K) in float32 through transformers."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def make_adapters(root, path: str = STORIES) -> dict[str, LoRARequest]:
    """The three :data:`SPECS` PEFT adapters for the model at ``path`` (random A and B: ``init_lora_weights=False``),
    saved under ``root`` as PEFT saves them; ids 1, 2, 3."""
    out = {}
    for i, (name, (rank, alpha, targets, rslora)) in enumerate(SPECS.items(), start=1):
        torch.manual_seed(i)
        model = peft.get_peft_model(base_model(path), peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False))
        model.save_pretrained(root / name)
        out[name] = LoRARequest(name, i, str(root / name))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, LoRARequest]:
    """The three stories260K PEFT adapters (:func:`make_adapters`)."""
    return make_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def oracle(adapters):
    """``(prompt, adapter name or None) -> greedy token ids`` from transformers (+ ``PeftModel``), memoized."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    cache: dict[tuple[str, str | None], list[int]] = {}

    def tokens(prompt: str, name: str | None) -> list[int]:
        if (prompt, name) not in cache:
            model = base_model()
            if name is not None:
                model = peft.PeftModel.from_pretrained(model, adapters[name].lora_path)
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=NUM_TOKENS, do_sample=False, max_length=None)
            cache[(prompt, name)] = out[0, ids.shape[1]:].tolist()
        return cache[(prompt, name)]
    return tokens
