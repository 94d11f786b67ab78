"""Pipeline parallelism's model side (``framework/model_executor/pipeline_parallel.py``): vLLM's layer split
and its override, the refusals, the stage model with its identity stand-ins, and stages chained in one
process giving the whole model's logits."""

from __future__ import annotations

import pytest
import torch
from families import tiny_config
from helpers import STORIES

from framework.config import EngineConfig
from framework.core.kv_cache_groups import KVCacheLayout
from framework.model_executor.pipeline_parallel import (
    PPMissingLayer,
    get_pp_indices,
    pipeline_refusals,
    pp_problems,
    split_stage,
    stage_forward,
    stage_kv_slots,
)


@pytest.mark.parametrize(("num_layers", "pp", "expected"), [
    (5, 2, [(0, 3), (3, 5)]),  # the remainder goes to the stages before the last
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (30, 4, [(0, 7), (7, 15), (15, 23), (23, 30)]),  # 7 + 8 + 8 + 7: counting back from the second-to-last
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
])
def test_split_follows_vllm(num_layers, pp, expected):
    assert [get_pp_indices(num_layers, r, pp) for r in range(pp)] == expected


def test_an_explicit_partition_overrides_the_split():
    assert [get_pp_indices(5, r, 3, "1,1,3") for r in range(3)] == [(0, 1), (1, 2), (2, 5)]


@pytest.mark.parametrize(("args", "match"), [
    ((5, 0, 6, None), r"pipeline_parallel_size=6 exceeds the model's 5 decoder layers"),
    ((5, 0, 2, "3,3"), r"2 positive layer counts .* summing to the model's 5 layers"),
    ((5, 0, 2, "5,0"), r"positive layer counts"),
    ((5, 0, 2, "a,b"), r"comma-separated integers"),
    ((5, 2, 2, None), r"pp_rank must be in \[0, 2\)"),
])
def test_bad_splits_name_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        get_pp_indices(*args)


def test_unverified_families_and_mla_are_refused():
    assert pp_problems(tiny_config("llama"), 2) == []
    assert pp_problems(tiny_config("gemma2"), 1) == []  # one stage: nothing to refuse
    (problem,) = pp_problems(tiny_config("gemma2"), 2)
    assert "'gemma2' is not verified under pipeline parallelism" in problem and "['llama']" in problem
    mla = tiny_config("llama")
    mla.qk_nope_head_dim, mla.v_head_dim = 8, 8
    assert any("MLA" in p for p in pp_problems(mla, 2))
    no_plan = tiny_config("llama")
    no_plan.base_model_pp_plan = None
    assert any("no base_model_pp_plan" in p for p in pp_problems(no_plan, 2))


def test_engine_features_not_wired_through_stages_are_refused():
    config = EngineConfig(model=STORIES, executor="mp", pipeline_parallel_size=2, drafter="ngram",
                          enable_lora=True, compile="true", enable_expert_parallel=True)
    problems = pipeline_refusals(config)
    assert [p.split(" does not")[0] for p in problems] == ["pipeline_parallel_size=2"] * 4
    assert "use parallel.enable_expert_parallel=false" in problems[3]
    assert "use spec_decode=none" in problems[0] and "lora.enable=false" in problems[1]
    assert "engine.compile=false" in problems[2]
    assert pipeline_refusals(EngineConfig(model=STORIES, executor="mp", pipeline_parallel_size=2)) == []


def test_uniproc_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 .*use executor=mp"):
        EngineConfig(model=STORIES, executor="uniproc", pipeline_parallel_size=2)
    assert EngineConfig(model=STORIES, pipeline_parallel_size=2).executor == "mp"  # auto


def test_a_stage_keeps_only_its_modules_and_kv_slots():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES)
    full = sum(p.numel() for p in model.parameters())
    assert split_stage(model, 1, 2) == (3, 5)
    missing = sorted(n for n, m in model.named_modules() if isinstance(m, PPMissingLayer))
    assert missing == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"]
    assert sum(p.numel() for p in model.parameters()) < full  # the LM head (tied) stays, three layers go
    assert model.model.layers[3].self_attn.layer_idx == 3  # global index: attention and KV cache slots
    assert stage_kv_slots(KVCacheLayout.single(5), 3, 5) == [3, 4]


@torch.inference_mode()
def test_chained_stages_give_the_whole_models_logits():
    """Three stages of stories260K (2 + 2 + 1 layers), each its own copy, the hidden states handed on by
    hand: the last stage's logits equal the unsplit model's (transformers' own attention here)."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 300, 301, 302, 303, 304, 305]])
    positions = torch.arange(ids.shape[1])[None]
    whole = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    expected = whole(input_ids=ids, position_ids=positions).logits[0]
    hidden = None
    for rank in range(3):
        stage = AutoModelForCausalLM.from_pretrained(STORIES).eval()
        split_stage(stage, rank, 3)
        hidden = stage_forward(stage, ids, positions, hidden, None)
    logits = stage.lm_head(hidden[0])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_missing_layer_is_the_identity():
    x = torch.randn(2, 3)
    assert PPMissingLayer()(x, attention_mask=None) is x
    assert PPMissingLayer()(hidden_states=x) is x
