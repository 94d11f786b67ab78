"""Multi-LoRA with speculative decoding on stories260K (float32, greedy), PEFT's ``PeftModel`` as the oracle.

The drafter proposes without the adapter (``ngram`` from tokens, ``draft_model`` from its base draft model, ``eagle``
from the target's adapted hidden states through a head trained on the base); the target verifies every draft with
the request's adapter, so a mixed batch of three adapters through ``max_loras=2`` slots plus the base model still
equals PEFT token for token. Each run must have proposed and accepted drafts, or it would check nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE
from lora_peft import NUM_TOKENS

from framework import LLM, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

# repeated phrases give the n-gram drafter something to look up
PROMPTS = ["Lily went to the park. Lily went to the park. Lily went to the",
           "Once upon a time, there was a cat. Once upon a time, there was a"]
STORIES_MEDUSA = str(Path(STORIES).parent / "stories260K-medusa")
EXTRA = {"ngram": {}, "draft_model": {"model": STORIES_DRAFT}, "eagle": {"model": STORIES_EAGLE},
         "medusa_tree": {"model": STORIES_MEDUSA, "tree": [[0], [1], [0, 0], [1, 0]]}}


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle", "medusa_tree"])
def test_a_mixed_batch_with_a_drafter_equals_peft(drafter, adapters, oracle):
    """``medusa_tree``: Medusa heads proposing a draft tree, verified in one tree-attention forward."""
    params = EXTRA[drafter] if "tree" in EXTRA[drafter] else {"num_speculative_tokens": 2, **EXTRA[drafter]}
    llm = LLM(STORIES, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3,
              num_blocks=128, drafter=drafter.removesuffix("_tree"), drafter_params=params)
    names = ["attn", None, "mlp", "all", "attn", "mlp"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                        lora_request=[adapters[n] if n else None for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == oracle(prompt, name), (drafter, prompt, name)
    summary = llm.engine.metrics.summary()
    assert summary["spec_num_draft_tokens"] > 0, "the drafter never proposed: the test checks nothing"
    assert llm.engine.executor.worker.lora.stats()["num_slot_swaps"] >= 3  # slots swapped under speculation
