"""``spec_decode.params.acceptance=typical`` (Medusa's typical acceptance, lossy) with Medusa trees on stories260K:
the sampled three-token joint is *not* the target's (chi-square against the exact joint, the threshold the exact
samplers pass, exceeded), it accepts at least as many tokens per verify step as exact SpecInfer sampling, greedy is
unchanged, and ``metrics.json`` labels the run; bad thresholds are refused before weights load."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
from helpers import STORIES, sibling_test_module

from framework import LLM, SamplingParams

STORIES_MEDUSA = str(Path(STORIES).parent / "stories260K-medusa")
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
NUM_SAMPLES = 1000


def _chain_distribution():
    """``test_spec_distribution.py`` (the chain drafters' test), imported once."""
    return sibling_test_module(__file__, "test_spec_distribution.py")


def _sample(make_llm, acceptance: str):
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREE, "acceptance": acceptance})
    ids = llm.get_tokenizer()(_chain_distribution().PROMPT).input_ids
    sp = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=2000 + i) for i in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": ids}] * NUM_SAMPLES, sp)
    counts = collections.Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    return ids, counts, llm.engine.metrics.summary()


def test_typical_differs_from_target_and_accepts_more(make_llm):
    chain = _chain_distribution()
    ids, typical, typical_summary = _sample(make_llm, "typical")
    _, exact, exact_summary = _sample(make_llm, "exact")
    joint = chain._exact_joint(ids)
    stat, df = chain._chi_square(typical, joint, NUM_SAMPLES)
    assert df > 5, "too few bins for a meaningful test"
    assert stat > df + 5 * math.sqrt(2 * df), f"chi-square {stat:.1f} with {df} dof: typical kept the target"
    exact_stat, _ = chain._chi_square(exact, joint, NUM_SAMPLES)
    assert exact_stat < stat, "exact sampling should sit closer to the target than typical acceptance"
    assert typical_summary["spec_acceptance"] == "typical" and exact_summary["spec_acceptance"] == "exact"
    assert typical_summary["spec_mean_accepted_length"] >= exact_summary["spec_mean_accepted_length"]


def test_greedy_unchanged(make_llm):
    prompts = ["Once upon a time", "The dog ran to the park and"]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    base = make_llm().generate(prompts, sp)
    typical = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREE,
                                                         "acceptance": "typical"}).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in typical] == [o.outputs[0].token_ids for o in base]


@pytest.mark.parametrize("params, match", [({"acceptance": "lossy"}, "acceptance"),
                                           ({"acceptance": "typical", "epsilon": 2.0}, "epsilon"),
                                           ({"acceptance": "typical", "delta": -1.0}, "delta")])
def test_bad_acceptance_refused(params, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=STORIES, drafter="medusa", drafter_params={"model": STORIES_MEDUSA, **params})
