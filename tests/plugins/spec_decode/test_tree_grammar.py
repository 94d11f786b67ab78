"""Structured output with token trees (``framework/core/grammar_trees.py``): a constrained request verifies its whole
Medusa tree, each node's verify row masked with the grammar state after its own root-to-node path; greedy output
under a JSON schema equals the grammar-only run without speculation token for token, satisfies the schema, and
accepts more than one token per verify step on average; random requests' outputs satisfy their constraints."""

from __future__ import annotations

from pathlib import Path

from grammar_helpers import SPECS, check_output
from helpers import STORIES

import framework.core.structured_output as structured_output
from framework import SamplingParams, StructuredOutputsParams

STORIES_MEDUSA = str(Path(STORIES).parent / "stories260K-medusa")
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
PROMPTS = ["Once upon a time", "The dog ran to the park and", "Max had a toy car"]


def test_greedy_json_with_trees_equals_no_speculation(make_llm, monkeypatch):
    filled = {"rows": 0, "trees": 0}
    fill = structured_output.fill_tree_bitmask

    def recording(matcher, bitmask, first_row, token_ids, parents):
        offsets = fill(matcher, bitmask, first_row, token_ids, parents)
        filled["rows"] += len(offsets)
        filled["trees"] += 1
        # drafts were cut to the nodes the grammar accepts when proposed: every row is filled
        assert len(offsets) == len(token_ids) + 1, (token_ids, parents)
        return offsets

    monkeypatch.setattr(structured_output, "fill_tree_bitmask", recording)
    params = SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=StructuredOutputsParams(
        json=SPECS["json"]))
    spec = make_llm(grammar="xgrammar", drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREE})
    plain = make_llm(grammar="xgrammar")
    outs, ref = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    for a, b in zip(outs, ref):
        assert a.error is None and a.outputs[0].finish_reason == "stop", a.outputs[0]
        check_output("json", a.outputs[0].text)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert filled["trees"] > 0 and filled["rows"] > filled["trees"], "no constrained tree was verified"
    summary = spec.engine.metrics.summary()
    assert summary["spec_mean_accepted_length"] > 1.0, summary["spec_mean_accepted_length"]


def test_random_constrained_requests_with_trees(make_llm):
    kinds = ["json", "regex", "grammar"]
    params = [SamplingParams(temperature=0.8, max_tokens=160, seed=i,
                             structured_outputs=StructuredOutputsParams(**{kind: SPECS[kind]}))
              for i, kind in enumerate(kinds)]
    spec = make_llm(grammar="xgrammar", drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREE})
    outs = spec.generate(PROMPTS, params)
    for kind, out in zip(kinds, outs):
        assert out.error is None and out.outputs[0].finish_reason == "stop", out.outputs[0]
        check_output(kind, out.outputs[0].text)
    assert spec.engine.metrics.summary()["spec_num_draft_tokens"] > 0
