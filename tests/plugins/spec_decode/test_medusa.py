"""Medusa drafter and token-tree verification: greedy output with several tree shapes is token-identical to
transformers (float32, stories260K), with trees of different sizes in one batch (pruned near ``max_tokens``), under
chunked prefill and preemption, with no KV block leaked; tree sampling keeps the target distribution; the public
Medusa layout (``.safetensors`` and ``.pt``) loads; misconfigurations are refused before weights load."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers import STORIES, hf_greedy, sibling_test_module

from framework import SamplingParams, hookimpl, registry
from framework.core.spec_tree import DraftTree, parse_tree_paths, paths_parents
from plugins.spec_decode._medusa_heads import load_medusa_heads, read_medusa_weights, save_medusa_heads

STORIES_MEDUSA = str(Path(STORIES).parent / "stories260K-medusa")
PROMPTS = ["Once upon a time", "The dog ran to the park and", "Max had a toy car",
           "Lily and Tom went to the park. Lily and Tom went to the park. Lily and",
           "One day, a little boy named Tim went to the store with his mom. He saw a big red ball"]
TREES = {
    "chain": [[0], [0, 0], [0, 0, 0]],
    "wide": [[0], [1], [2], [3]],
    "medusa": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
    "deep_branch": [[1], [0], [0, 1], [0, 0], [0, 0, 0], [0, 0, 2], [0, 0, 0, 0], [0, 0, 0, 1]],
}


def _check(llm, prompts=PROMPTS, max_tokens=40):
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    for i, (out, exp) in enumerate(zip(outs, hf_greedy(STORIES, ids, max_tokens))):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers"
    summary = llm.engine.metrics.summary()
    assert summary["spec_num_accepted_tokens"] > 0, "nothing accepted: the test checks nothing"
    return summary


@pytest.mark.parametrize(("attention", "shape"), [("torch_paged", shape) for shape in TREES]
                         + [("torch", "chain"), ("torch", "deep_branch")])
def test_greedy_tree_output_equals_transformers(make_llm, shape, attention):
    """Every tree shape on ``torch_paged``; ``torch`` (the same tree mask, another attention path) with a chain and
    the branchiest tree."""
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES[shape]},
                   attention=attention, dtype="float32")
    summary = _check(llm, max_tokens=24)  # every shape verifies trees and prunes them near max_tokens
    depth = max(len(p) for p in TREES[shape])
    assert 1.0 < summary["spec_mean_accepted_length"] <= depth + 1
    assert len(summary["spec_acceptance_by_position"]) == depth  # one rate per tree depth


def test_chain_default_and_a_tree_accepts_more(make_llm):
    chain = _check(make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "num_speculative_tokens": 3}))
    tree = _check(make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES["medusa"]}))
    assert tree["spec_mean_accepted_length"] > chain["spec_mean_accepted_length"]


def test_chunked_prefill_and_preemption(make_llm):
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES["medusa"]},
                   num_blocks=12, block_size=16, max_model_len=160, max_num_batched_tokens=24, long_prefill_token_threshold=8,
                   enable_prefix_caching=False)
    _check(llm, PROMPTS + PROMPTS, max_tokens=64)
    assert llm.engine.metrics.summary()["num_preemptions"] > 0


def test_prefix_caching_with_trees(make_llm):
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES["deep_branch"]},
                   block_size=4, num_blocks=200)
    _check(llm, PROMPTS + PROMPTS, max_tokens=30)
    assert llm.engine.kv_allocator.stats().hit_rate > 0


def test_rejected_branches_hold_no_block(make_llm):
    """In flight, after every step, each request holds only the blocks of its computed tokens plus one tree's worth
    (the rejected branches' slots are reused by the next step), every block is either held or free, and the
    allocator's invariants hold; at the end every block is free (``make_llm``)."""
    tree, bs = TREES["medusa"], 4
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": tree}, block_size=bs,
                   enable_prefix_caching=False)
    engine, kv = llm.engine, llm.engine.kv_allocator
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=40))
    trees = 0
    while engine.has_unfinished_requests():
        engine.step()
        held = 0
        for r in engine.scheduler.running:
            blocks = len(kv.get_block_ids(r.request_id))
            held += blocks
            assert -(-r.num_computed_tokens // bs) <= blocks <= -(-(r.num_computed_tokens + 1 + len(tree)) // bs)
            trees += bool(r.spec_parents)
        assert held + kv.num_free_blocks == kv.num_blocks
        if hasattr(kv, "check_invariants"):
            kv.check_invariants()
    assert trees > 0


def test_random_and_grammar_requests(make_llm):
    """A random request verifies the whole tree (SpecInfer's multi-step sampling); a greedy one too."""
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES["medusa"]})
    engine = llm.engine
    engine.add_request("greedy", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=24))
    engine.add_request("random", "Once upon a time", SamplingParams(temperature=0.8, max_tokens=24, seed=3))
    shapes = set()
    while engine.has_unfinished_requests():
        engine.step()
        for r in engine.scheduler.running:
            if r.spec_token_ids:
                shapes.add((r.request_id, bool(r.spec_parents)))
    assert ("greedy", True) in shapes and ("random", True) in shapes


class _FixedTree(registry.KINDS["drafter"][1]):
    """Always the same poor tree (three siblings, a grandchild): most candidates are rejected."""

    name = "fixed_tree"
    drafts_trees = True

    def propose(self, requests):
        return {r.request_id: DraftTree([7, 8, 261, 9], [-1, -1, -1, 2]) for r in requests}


class _FixedTreePlugin:
    @hookimpl
    def register_drafters(self, register):
        register("fixed_tree", _FixedTree)


def _chain_distribution():
    """``test_spec_distribution.py`` (the chain drafters' test), imported once."""
    return sibling_test_module(__file__, "test_spec_distribution.py")


@functools.cache
def _exact_joint(prompt_ids: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    """The target's exact joint of the first three tokens after ``prompt_ids``, computed once for the three drafters."""
    return _chain_distribution()._exact_joint(list(prompt_ids))


@pytest.mark.parametrize("drafter", ["medusa", "fixed_tree", "eagle"])
def test_tree_sampling_keeps_target_distribution(make_llm, drafter):
    """Chi-square of the first three sampled tokens against the exact target joint (the chain drafters' test in
    test_spec_distribution.py, same power: 3,000 samples, every bin with >= 5 expected): a Medusa tree, a poor fixed
    tree and EAGLE-2 dynamic trees."""
    import collections
    import math

    chain = _chain_distribution()
    NUM_SAMPLES, PROMPT, _chi_square = chain.NUM_SAMPLES, chain.PROMPT, chain._chi_square  # noqa: N806

    params = {"medusa": {"model": STORIES_MEDUSA, "tree": TREES["medusa"]}, "fixed_tree": {},
              "eagle": {"model": str(Path(STORIES).parent / "stories260K-eagle"), "tree": "dynamic", "topk": 3,
                        "num_draft_tokens": 8, "num_speculative_tokens": 3}}[drafter]
    with registry.registered(_FixedTreePlugin()):
        llm = make_llm(drafter=drafter, drafter_params=params)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    sp = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1000 + i) for i in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": ids}] * NUM_SAMPLES, sp)
    counts = collections.Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    stat, df = _chi_square(counts, _exact_joint(tuple(ids)), NUM_SAMPLES)
    assert df > 10, "too few bins for a meaningful test"
    assert stat < df + 5 * math.sqrt(2 * df), f"chi-square {stat:.1f} with {df} dof: not the target distribution"
    summary = llm.engine.metrics.summary()
    assert summary["spec_num_draft_tokens"] > NUM_SAMPLES, "trees were not verified"


def test_compiled_target_keeps_parity_without_recompiles(make_llm):
    """engine.compile=true: tree verify steps (several tokens per request, trees pruned to different sizes near
    max_tokens) run the compiled decoder with the opaque attention op; output equals transformers and no graph is
    compiled after the warm-up (``torch`` spares compiling ``torch_paged``'s traced-decode graphs)."""
    llm = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES["medusa"]}, compile=True,
                   attention="torch")
    assert llm.engine.runner.compile_stats.active
    _check(llm, PROMPTS[:3], max_tokens=30)
    assert llm.engine.runner.compile_stats.num_recompiles == 0


def test_penalties_and_logprobs_match_no_speculation(make_llm):
    """Each verify row of a tree sees the output plus its node's path (repetition penalty, min_tokens), and the
    logprobs of an accepted path come from its nodes' rows: greedy outputs and logprobs equal a run without
    speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.3, min_tokens=20, logprobs=2)
    plain = make_llm().generate(PROMPTS, params)
    tree = make_llm(drafter="medusa", drafter_params={"model": STORIES_MEDUSA, "tree": TREES["medusa"]})
    outs = tree.generate(PROMPTS, params)
    assert tree.engine.metrics.summary()["spec_num_accepted_tokens"] > 0
    for a, b in zip(plain, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_draft_tree_rules():
    paths = parse_tree_paths([[0, 1], [1], [0]])
    assert paths == [[0], [1], [0, 1]] and paths_parents(paths) == [-1, -1, 0]
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2])
    assert tree.depths() == [1, 1, 2, 3] and not tree.is_chain
    assert tree.main_chain() == DraftTree([5, 7, 8], [-1, 0, 1])
    assert tree.pruned(max_depth=2, max_nodes=2) == DraftTree([5, 6], [-1, -1])
    for bad in ([[0, 0]], [[0], [0]], [[-1]], "nope"):
        with pytest.raises(ValueError):
            parse_tree_paths(bad)
    with pytest.raises(ValueError, match="parents must precede"):
        DraftTree([1, 2], [1, -1])


def test_public_layout_round_trip(tmp_path):
    """safetensors -> .pt under the public keys -> the same heads."""
    heads = load_medusa_heads(STORIES_MEDUSA, torch.float32, torch.device("cpu"))
    weights = read_medusa_weights(STORIES_MEDUSA)
    assert {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "3.1.weight"} <= set(weights)
    save_medusa_heads(heads, tmp_path / "a")
    (tmp_path / "a" / "medusa_lm_head.safetensors").unlink()
    torch.save(weights, tmp_path / "a" / "medusa_lm_head.pt")
    again = load_medusa_heads(tmp_path / "a", torch.float32, torch.device("cpu"))
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(heads(x), again(x))


@pytest.mark.parametrize(("drafter", "params", "match"), [
    ("medusa", {}, "needs spec_decode.params.model"),
    ("medusa", {"model": STORIES_MEDUSA, "tree": [[0] * d for d in range(1, 6)]}, "5 deep but"),
    ("medusa", {"model": STORIES_MEDUSA, "tree": [[0, 1]]}, "has no parent path"),
    ("medusa", {"model": STORIES_MEDUSA, "tree": "dynamic"}, "tree=dynamic: spec_decode=eagle only"),
    ("ngram", {"tree": [[0], [1]]}, "drafts chains only"),
])
def test_misconfigurations_refused(drafter, params, match):
    from framework.config import EngineConfig
    from framework.engine.builder import validate_plugins

    with pytest.raises(ValueError, match=match):
        validate_plugins(EngineConfig(model=STORIES, drafter=drafter, drafter_params=params))


def test_pipeline_parallel_refused_tensor_parallel_allowed():
    """Trees run under tensor parallelism (``tests/plugins/spec_decode/test_tree_tensor_parallel.py``), not across
    pipeline stages."""
    from framework.config import EngineConfig
    from framework.engine.spec_tree_support import tree_problems

    params = {"model": STORIES_MEDUSA, "tree": [[0], [1]]}
    config = EngineConfig(model=STORIES, drafter="medusa", pipeline_parallel_size=2, drafter_params=params)
    assert any("pipeline_parallel_size=1" in p for p in tree_problems(config))
    assert tree_problems(EngineConfig(model=STORIES, drafter="medusa", tensor_parallel_size=2,
                                      drafter_params=params)) == []


def test_train_medusa_writes_usable_heads(tmp_path, capsys):
    from experiments.quality import train_medusa

    out = tmp_path / "heads"
    train_medusa.main(["--model", STORIES, "--out", str(out), "--num-sequences", "12", "--max-tokens", "24",
                       "--epochs", "1", "--gen-dtype", "float32", "--num-heads", "2"])
    assert "held-out top-1 per head" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "medusa_lm_head.safetensors").is_file()
    heads = load_medusa_heads(out, torch.float32, torch.device("cpu"))
    assert heads.config.num_heads == 2 and heads.config.vocab_size == 512
