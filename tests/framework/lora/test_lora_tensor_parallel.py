"""Multi-LoRA under tensor parallelism (``executor=mp``, two ranks, stories260K float32 greedy): each rank's slots
hold its cut of A and B (``framework/model_executor/lora_tp.py``, vLLM's column/row-parallel LoRA layers), and a mixed
batch of three adapters (two slots) and the base equals PEFT token for token, eagerly and with ``engine.compile=true``
(the LoRA op inside each rank's layer graphs, next to the all-reduce)."""

from __future__ import annotations

import pytest
from helpers import STORIES
from lora_peft import NUM_TOKENS, PROMPTS

from framework import LLM, SamplingParams
from framework.model_executor.lora_tp import lora_shards
from framework.model_executor.model_loader import load_model_config

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def test_column_parallel_cuts_b_rows_and_row_parallel_cuts_a_columns():
    config = load_model_config(STORIES)
    shards, full = lora_shards(config, tp_rank=1, tp_size=2)
    hidden, inter = config.hidden_size, config.intermediate_size
    layer = "model.layers.0"
    assert full[f"{layer}.mlp.down_proj"] == (inter, hidden)
    for name in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj"):  # column-parallel: output rows
        out = full[f"{layer}.{name}"][1]
        shard = shards[f"{layer}.{name}"]
        assert (shard.dim, shard.start, shard.stop) == (0, out // 2, out), name
    for name, width in (("self_attn.o_proj", hidden), ("mlp.down_proj", inter)):  # row-parallel: input columns
        shard = shards[f"{layer}.{name}"]
        assert (shard.dim, shard.start, shard.stop) == (1, width // 2, width), name
    assert set(shards) == set(full)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_tensor_parallel_mixed_batch_equals_peft(compile, adapters, oracle):
    llm = LLM(STORIES, dtype="float32", attention="torch", enable_lora=True, max_lora_rank=8, max_loras=2,
              max_cpu_loras=2, num_blocks=128, executor="mp", tensor_parallel_size=2, compile=compile,
              compile_backend="eager")
    try:
        names = ["attn", None, "mlp", "all", "attn", "all", "mlp"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                            lora_request=[adapters[n] if n else None for n in names])
        for prompt, name, out in zip(prompts, names, outs):
            assert out.error is None and out.outputs[0].token_ids == oracle(prompt, name), (prompt, name)
        stats = llm.engine.executor.collective_rpc("compile_stats")
        assert all(s.active == compile and s.num_recompiles == 0 for s in stats), stats
    finally:
        llm.engine.shutdown()
