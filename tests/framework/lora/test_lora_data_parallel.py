"""Multi-LoRA over offline data-parallel replicas (``parallel.data_parallel_size=2``, stories260K float32 greedy):
the router sends each request, adapter and all, to a replica that loads it on demand into its own slots; a mixed
batch of three adapters (two slots per replica) and the base equals PEFT token for token."""

from __future__ import annotations

import pytest
from helpers import STORIES
from lora_peft import NUM_TOKENS, PROMPTS

from framework import LLM, SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_data_parallel_replicas_equal_peft(adapters, oracle):
    llm = LLM(STORIES, dtype="float32", attention="torch", enable_lora=True, max_lora_rank=8, max_loras=2,
              max_cpu_loras=2, num_blocks=128, data_parallel_size=2)
    try:
        names = ["attn", None, "mlp", "all", "attn", "all", "mlp", None]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                            lora_request=[adapters[n] if n else None for n in names])
        for prompt, name, out in zip(prompts, names, outs):
            assert out.error is None and out.outputs[0].token_ids == oracle(prompt, name), (prompt, name)
        served = [replica.metrics.summary()["num_requests"] for replica in llm.engine.replicas]
        assert len(served) == 2 and all(n > 0 for n in served) and sum(served) == len(names), served
    finally:
        llm.engine.shutdown()
