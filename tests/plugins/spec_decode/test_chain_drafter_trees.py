"""``draft_model`` and ``eagle`` with ``spec_decode.params.tree``: the top-1 chain plus each depth's top-k guesses as
leaves; greedy output is token-identical to transformers (float32, stories260K), a tree accepts more per verify step
than the same drafter's chain, and a tree branching off a non-top-1 guess is refused before weights load; ``eagle``
with ``tree=dynamic`` (EAGLE-2) likewise equals transformers and accepts more than its chain."""

from __future__ import annotations

import pytest
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE, hf_greedy

from framework import SamplingParams

PROMPTS = ["Once upon a time", "The dog ran to the park and", "Max had a toy car",
           "One day, a little boy named Tim went to the store with his mom. He saw a big red ball"]
MODELS = {"draft_model": STORIES_DRAFT, "eagle": STORIES_EAGLE}
SIBLINGS = [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]]


def _run(make_llm, drafter, **params):
    llm = make_llm(drafter=drafter, drafter_params={"model": MODELS[drafter], **params}, dtype="float32")
    ids = [llm.get_tokenizer()(p).input_ids for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=32))
    for i, (out, exp) in enumerate(zip(outs, hf_greedy(STORIES, ids, 32))):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
    draft_kv = llm.engine.drafter.kv  # the draft's own block pool is empty again (tree nodes' slots included)
    assert draft_kv.num_free_blocks == draft_kv.num_blocks, "draft KV blocks leaked"
    return llm.engine.metrics.summary()


@pytest.mark.parametrize("drafter", list(MODELS))
def test_sibling_tree_equals_transformers_and_accepts_more(make_llm, drafter):
    chain = _run(make_llm, drafter, num_speculative_tokens=3)
    tree = _run(make_llm, drafter, tree=SIBLINGS)
    assert len(tree["spec_acceptance_by_position"]) == 3
    assert tree["spec_mean_accepted_length"] > chain["spec_mean_accepted_length"]


@pytest.mark.parametrize("drafter", list(MODELS))
def test_branch_off_a_lower_guess_refused(drafter):
    from framework.config import EngineConfig
    from framework.engine.builder import validate_plugins

    config = EngineConfig(model=STORIES, drafter=drafter, drafter_params={"model": MODELS[drafter],
                                                                           "tree": [[0], [1], [1, 0]]})
    with pytest.raises(ValueError, match=r"every rank but a path's last must be 0; \[1, 0\]"):
        validate_plugins(config)


def test_eagle_dynamic_tree_equals_transformers_and_accepts_more(make_llm):
    chain = _run(make_llm, "eagle", num_speculative_tokens=3)
    tree = _run(make_llm, "eagle", num_speculative_tokens=3, tree="dynamic", topk=3, num_draft_tokens=8)
    assert tree["spec_mean_accepted_length"] > chain["spec_mean_accepted_length"]
    assert tree["spec_num_draft_tokens"] > chain["spec_num_draft_tokens"]


@pytest.mark.parametrize(("drafter", "params", "match"), [
    ("eagle", {"tree": "dynamic", "topk": 0}, "topk must be an integer >= 1"),
    ("medusa", {"tree": "dynamic"}, "tree=dynamic: spec_decode=eagle only"),
    ("draft_model", {"tree": "dynamic"}, "tree=dynamic: spec_decode=eagle only"),
])
def test_dynamic_tree_refusals(drafter, params, match):
    from pathlib import Path

    from framework.config import EngineConfig
    from framework.engine.builder import validate_plugins

    model = MODELS.get(drafter, str(Path(STORIES).parent / "stories260K-medusa"))
    with pytest.raises(ValueError, match=match):
        validate_plugins(EngineConfig(model=STORIES, drafter=drafter, drafter_params={"model": model, **params}))
