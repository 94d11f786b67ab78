"""Tensor parallelism for every family (``ModelFamily.tp`` in ``framework/model_executor/model_families.py``):
each newly verified family's tiny random-weight model (``tests/families.py``) at ``tensor_parallel_size=2``
gives transformers' greedy tokens: all of them in one spawned gloo group (``tests/tp_harness.py``: logits
and per-layer hidden states too), and, ``slow``, served by an engine (``executor=mp``, float32, chunked
prefill, prefix caching and preemption forced; log-probabilities too). Every family not verified is
refused with its reason before any worker starts. Llama, Mistral, Qwen2 and Qwen3 are checked in
``test_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
from families import assert_matches_transformers, hf_reference, prompts, run_family, tiny_config, tiny_model_dir
from tp_harness import run_cases, spawn_ranks

from framework.model_executor.model_families import FAMILIES, TP_VERIFIED
from framework.model_executor.model_loader import load_model
from framework.model_executor.tensor_parallel import PLAN_OVERRIDES, meta_model, resolved_plan, tp_problems

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

CHECKED_IN_TEST_TENSOR_PARALLEL = ("llama", "mistral", "qwen2", "qwen3")
NEWLY_VERIFIED = tuple(f.test_id for f in FAMILIES
                       if f.tp == TP_VERIFIED and f.test_id not in CHECKED_IN_TEST_TENSOR_PARALLEL)
REFUSED = tuple(f for f in FAMILIES if f.tp != TP_VERIFIED)


def test_every_family_has_a_tp_record() -> None:
    """Each family is verified or says why not; the families with plan overrides are verified ones."""
    assert {f.test_id for f in REFUSED} == {"gpt_oss", "gpt2"}
    assert all(f.tp and f.tp != "not checked under tensor parallelism" for f in FAMILIES)
    kinds = {kind: f.tp for f in FAMILIES for kind in f.model_types}
    assert all(kinds[kind] == TP_VERIFIED for kind in PLAN_OVERRIDES)


@pytest.mark.parametrize("family", [f.test_id for f in REFUSED])
def test_unverified_family_refused_with_its_reason(family: str) -> None:
    """``tp_problems`` (the builder's pre-load check) names the family's reason and the one size that works."""
    row = next(f for f in FAMILIES if f.test_id == family)
    problems = tp_problems(tiny_config(family), 2)
    assert len(problems) == 2 and row.tp in problems[0] and "tensor_parallel_size=1" in problems[0]
    assert problems[1].endswith(": [1]")


def test_refusal_comes_before_any_worker_starts(make_llm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building an engine of a refused family raises from the config check; no executor is made."""
    from families import tiny_model_dir

    from framework.engine import builder

    def no_executor(*args, **kwargs):
        raise AssertionError("an executor was started for a refused model")

    monkeypatch.setattr(builder, "make_executor", no_executor)
    with pytest.raises(ValueError, match="is not run tensor-parallel: transformers' plan shards only its embedding"):
        make_llm(model=str(tiny_model_dir("gpt_oss")), tensor_parallel_size=2, dtype="float32")


def test_overrides_shard_heads_instead_of_gathering() -> None:
    """Phi-3's fused qkv and OLMo's full-width q/k norms are split by heads (transformers' plan gathers them)."""
    phi3 = resolved_plan(meta_model(tiny_config("phi3")))
    assert phi3["model.layers.0.self_attn.qkv_proj"] == "qkv_colwise"
    assert phi3["model.layers.0.mlp.gate_up_proj"] == "packed_colwise"
    olmo2 = resolved_plan(meta_model(tiny_config("olmo2")))
    assert olmo2["model.layers.1.self_attn.k_norm"] == "sharded_norm"
    assert olmo2["model.layers.1.self_attn.o_proj"] == "rowwise"


NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tp2_families() -> list[dict[str, dict]]:
    """Every newly verified family's results on both ranks of one TP=2 group (one spawn for all)."""
    cases = [{"name": f, "path": str(tiny_model_dir(f)), "prompt": prompts(1)[0], "new_tokens": NEW_TOKENS}
             for f in NEWLY_VERIFIED]
    return spawn_ranks(run_cases, 2, cases)


@pytest.mark.parametrize("family", NEWLY_VERIFIED)
def test_family_tp2_shards_equal_transformers(tp2_families: list[dict], family: str) -> None:
    """Both ranks' greedy tokens equal transformers' ``generate``; the driver's logits and every layer's
    hidden states are within 1e-5 (relative to their scale) of the unsharded model's."""
    prompt = prompts(1)[0]
    want_tokens = hf_reference(family, [prompt], NEW_TOKENS)[0][0]
    assert [rank[family]["tokens"] for rank in tp2_families] == [want_tokens, want_tokens]
    model = load_model(str(tiny_model_dir(family)), attn_implementation="eager").model
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([prompt]), output_hidden_states=True, use_cache=False)
    for got, want in [(tp2_families[0][family]["logits"], ref.logits),
                      *((g, w) for rank in tp2_families for g, w in zip(rank[family]["hidden"], ref.hidden_states))]:
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item(), family


@pytest.mark.slow
@pytest.mark.parametrize("family", NEWLY_VERIFIED)
def test_family_tp2_engine_matches_transformers(make_llm, family: str) -> None:
    """Greedy tokens equal transformers' ``generate`` and top-5 log-probabilities agree within 1e-4.

    ``torch_paged``'s in-place kernel runs eager (``compile=false``): at ``max_num_seqs=4`` no step reaches its
    ``min_paged_decodes=8``, so inductor's start-up warm-up of the kernel (each rank, each layer kind) was the
    only use of the compiler here, most of an engine's time; the kernel is compiled in ``test_torch_paged.py``."""
    llm, outs = run_family(make_llm, family, tensor_parallel_size=2, executor="mp", attention_params={"compile": False})
    assert_matches_transformers(family, outs, "tensor_parallel_size=2")


def test_expert_width_the_size_cannot_split_is_refused() -> None:
    """Experts split along their intermediate features: a width ``tp`` does not divide names them."""
    config = tiny_config("qwen3_moe")
    config.moe_intermediate_size = 30
    problems = tp_problems(config, 4)
    assert any("mlp.experts (moe_tp_experts): intermediate features=30 is not divisible by "
               "tensor_parallel_size=4" in p for p in problems)
    assert problems[-1].endswith("[1, 2]")


@pytest.mark.slow
def test_kv_replicated_over_four_ranks() -> None:
    """TP=4 over 2 KV heads (each on two ranks): OLMo's k norm counts replicated values once, Phi-3's fused
    qkv takes its KV head's rows; greedy tokens equal transformers' on every rank (MoE included)."""
    families = ("olmo2", "olmoe", "phi3", "qwen3_moe")
    prompt = prompts(1)[0]
    cases = [{"name": f, "path": str(tiny_model_dir(f)), "prompt": prompt, "new_tokens": NEW_TOKENS} for f in families]
    ranks = spawn_ranks(run_cases, 4, cases)
    for family in families:
        want = hf_reference(family, [prompt], NEW_TOKENS)[0][0]
        assert [rank[family]["tokens"] for rank in ranks] == [want] * 4, family
