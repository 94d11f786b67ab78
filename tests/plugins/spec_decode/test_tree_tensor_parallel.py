"""Token trees under tensor parallelism (``executor=mp``, TP=2, float32 stories260K): greedy output with Medusa trees
and EAGLE-2 dynamic trees equals transformers token for token, with trees of different sizes in one batch and, for
Medusa, recompute preemption (too few blocks for every request at once). Each rank moves its own shard of the accepted
path's K/V (``framework/worker/spec_tree_ranks.py``): a rank that did not would read a rejected sibling's K/V as the
path's and diverge within a few tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import STORIES, STORIES_EAGLE, hf_greedy

from framework import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

STORIES_MEDUSA = str(Path(STORIES).parent / "stories260K-medusa")
PROMPTS = ["Once upon a time", "The dog ran to the park and", "Max had a toy car",
           "One day, a little boy named Tim went to the store with his mom. He saw a big red ball"]
MEDUSA = {"model": STORIES_MEDUSA, "tree": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]}
EAGLE = {"model": STORIES_EAGLE, "tree": "dynamic", "topk": 3, "num_speculative_tokens": 3, "num_draft_tokens": 8}
MAX_TOKENS = 32


@pytest.mark.slow
@pytest.mark.parametrize(("drafter", "params", "engine"), [
    ("medusa", MEDUSA, {"block_size": 8, "num_blocks": 14, "max_model_len": 96}),  # preempts (recompute)
    ("eagle", EAGLE, {}),
], ids=["medusa-preempting", "eagle-dynamic"])
def test_greedy_tree_output_over_two_ranks_equals_transformers(drafter, params, engine):
    llm = LLM(model=STORIES, executor="mp", tensor_parallel_size=2, dtype="float32", grammar="none",
              drafter=drafter, drafter_params=params, **engine)
    try:
        tok = llm.get_tokenizer()
        ids = [tok(p).input_ids for p in PROMPTS]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        for i, (out, exp) in enumerate(zip(outs, hf_greedy(STORIES, ids, MAX_TOKENS))):
            assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
        summary = llm.engine.metrics.summary()
        assert summary["spec_num_accepted_tokens"] > 0 and summary["spec_mean_accepted_length"] > 1.0
        if "num_blocks" in engine:
            assert summary["num_preemptions_recompute"] > 0, "no preemption: the test checks less than it says"
    finally:
        llm.engine.shutdown()
