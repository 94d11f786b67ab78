"""Bad speculative-decoding input is refused at start-up, before weights load, naming the fix."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE

from framework import LLM


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("k", [0, -1])
def test_num_speculative_tokens_below_one(drafter, k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=STORIES, drafter=drafter, drafter_params={
            "num_speculative_tokens": k, "model": STORIES_EAGLE if drafter == "eagle" else STORIES_DRAFT})


def test_draft_model_missing_path():
    with pytest.raises(ValueError, match="spec_decode.params.model"):
        LLM(model=STORIES, drafter="draft_model")
    with pytest.raises(ValueError, match="cannot read the draft model"):
        LLM(model=STORIES, drafter="draft_model", drafter_params={"model": "/nonexistent/draft"})


def test_draft_model_other_vocabulary(tmp_path):
    other = tmp_path / "draft"
    shutil.copytree(STORIES_DRAFT, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 1024
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(model=STORIES, drafter="draft_model", drafter_params={"model": str(other)})


def test_ngram_bad_lookup_sizes():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(model=STORIES, drafter="ngram", drafter_params={"prompt_lookup_min": 3, "prompt_lookup_max": 2})


def test_eagle_missing_path():
    with pytest.raises(ValueError, match="spec_decode.params.model"):
        LLM(model=STORIES, drafter="eagle")
    with pytest.raises(ValueError, match="cannot read the EAGLE head"):
        LLM(model=STORIES, drafter="eagle", drafter_params={"model": "/nonexistent/head"})


@pytest.mark.parametrize("field,value,match", [("hidden_size", 96, "hidden_size 96 but the target has 64"),
                                               ("vocab_size", 1024, "vocabulary 1024")])
def test_eagle_head_that_does_not_fit_the_target(tmp_path, field, value, match):
    head = tmp_path / "head"
    shutil.copytree(STORIES_EAGLE, head)
    cfg = json.loads((head / "config.json").read_text())
    cfg[field] = value
    (head / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(model=STORIES, drafter="eagle", drafter_params={"model": str(head)})


def test_eagle_weights_that_do_not_fit_their_config(tmp_path):
    import torch

    head = tmp_path / "head"
    shutil.copytree(STORIES_EAGLE, head)
    weights = torch.load(head / "pytorch_model.bin", weights_only=True)
    del weights["layers.0.mlp.up_proj.weight"]
    torch.save(weights, head / "pytorch_model.bin")
    with pytest.raises(ValueError, match="missing.*up_proj"):
        LLM(model=STORIES, drafter="eagle", drafter_params={"model": str(head)})


@pytest.mark.parametrize("drafter,path", [("draft_model", STORIES_DRAFT), ("eagle", STORIES_EAGLE)])
def test_abort_frees_drafter_state(make_llm, drafter, path):
    from framework import SamplingParams

    llm = make_llm(drafter=drafter, drafter_params={"num_speculative_tokens": 2, "model": path})
    engine = llm.engine
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=32))
    engine.add_request("b", "Lily went to the park", SamplingParams(temperature=0.0, max_tokens=32))
    for _ in range(4):
        engine.step()
    assert engine.drafter.kv.num_free_blocks < engine.drafter.kv.num_blocks
    engine.abort_request(["a", "b"])
    assert engine.drafter.kv.num_free_blocks == engine.drafter.kv.num_blocks
    assert not getattr(engine.drafter, "_states", {}), "drafter state kept for aborted requests"
