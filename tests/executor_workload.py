"""The mixed workload every multi-rank executor test runs (``test_mp.py``, ``test_ray.py``): chunked
prefill, prefix caching, swap preemption, n-gram drafts and a JSON-schema request in one
``generate``, checked token for token against transformers (float32)."""

from __future__ import annotations

import torch
from grammar_helpers import SCHEMA, MaskProcessor
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS, hf_greedy

from framework import LLM, SamplingParams, StructuredOutputsParams

MAX_TOKENS = 24
# chunked prefill, prefix caching, swap preemption (28 blocks of 8 tokens), n-gram drafts
ENGINE = dict(model=STORIES, attention="torch", max_model_len=192, block_size=8, num_blocks=28,
              max_num_batched_tokens=48, long_prefill_token_threshold=16, preemption_mode="swap",
              swap_space_bytes=1 << 22, drafter="ngram", drafter_params={"num_speculative_tokens": 3},
              kv_cache_memory_bytes=1 << 50)  # unused (num_blocks is set): lets each rank report its RAM cap


def hf_grammar_greedy(llm: LLM, model_path: str, prompt_ids: list[int], so: StructuredOutputsParams,
                      max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` under the engine's grammar masks (the JSON request's oracle)."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    manager = llm.engine.structured_output
    proc = MaskProcessor(manager.grammar, manager.grammar.compile(*so.kind_and_spec()), len(prompt_ids),
                         manager.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        seq = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             logits_processor=LogitsProcessorList([proc]))
    return seq[0, len(prompt_ids):].tolist()


def check_every_feature_at_once(llm: LLM, what: str) -> None:
    """Run the mixed workload on ``llm`` (built with :data:`ENGINE`); ``what`` names the executor in
    failure messages.

    Raises:
        AssertionError: a request's tokens differ from transformers', or a feature did not trigger.
    """
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PREFIX_PROMPTS[:4] + STORY_PROMPTS[:5]]
    json_ids = tok("Tom wrote his name and age:").input_ids
    so = StructuredOutputsParams(json=SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)] * len(ids)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids + [json_ids]],
                        params + [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)])
    for i, (out, exp) in enumerate(zip(outs, hf_greedy(STORIES, ids, MAX_TOKENS))):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers under {what}"
    summary = llm.engine.metrics.summary()
    assert summary["num_preemptions_swap"] > 0 and summary["prefix_cache_hit_rate"] > 0
    assert summary["spec_num_accepted_tokens"] > 0
    assert summary["num_steps"] > MAX_TOKENS
    assert outs[-1].outputs[0].token_ids == hf_grammar_greedy(llm, STORIES, json_ids, so, 40)
