"""EAGLE drafter specifics: the checkpoint layout round-trips, the runner's hidden states are the
target's, and the shipped stories260K head drafts well enough that misaligned features would show."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import STORIES, STORIES_EAGLE

from framework import SamplingParams
from plugins.spec_decode._eagle_head import load_head, read_weights, save_head

PROMPTS = ["Once upon a time", "The dog ran to the park and", "Max had a toy car", "There was a big red ball.",
           "One day, a little girl named Lily found a shiny box", "Tom and Sue went to the park. They saw a bird"]


def _target():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


def test_layout_round_trip_and_variants(tmp_path):
    """save -> load gives the same head; safetensors files, bias-free fc and stored embeddings load."""
    from safetensors.torch import save_file

    target = _target()
    emb = target.get_input_embeddings()
    head = load_head(STORIES_EAGLE, emb, torch.float32, torch.device("cpu"), "sdpa")
    save_head(head, tmp_path / "a")
    again = load_head(tmp_path / "a", emb, torch.float32, torch.device("cpu"), "sdpa")
    ids, pos = torch.randint(0, 512, (2, 7)), torch.arange(7)[None].expand(2, 7)
    feats = torch.randn(2, 7, 64)
    with torch.no_grad():
        assert torch.equal(head(ids, pos, feats), again(ids, pos, feats))

    weights = read_weights(STORIES_EAGLE)
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= set(weights)
    assert not any(k.startswith("layers.0.input_layernorm") for k in weights), "EAGLE-1 layer 0 has no input norm"
    variant = tmp_path / "b"
    variant.mkdir()
    shutil.copy(tmp_path / "a" / "config.json", variant / "config.json")
    del weights["fc.bias"]
    weights["embed_tokens.weight"] = torch.zeros(512, 64)  # published heads may store it; it is ignored
    save_file(weights, str(variant / "model.safetensors"))
    nobias = load_head(variant, emb, torch.float32, torch.device("cpu"), "sdpa")
    assert nobias.fc.bias is None
    assert torch.equal(nobias.fc.weight, head.fc.weight)


def test_runner_hidden_states_are_the_targets_last_hidden_states(make_llm):
    """The rows the runner hands the drafter equal transformers' last hidden state (final norm
    applied) of the same tokens, position for position."""
    llm = make_llm(drafter="eagle", drafter_params={"model": STORIES_EAGLE, "num_speculative_tokens": 2})
    seen = {}
    observe = llm.engine.drafter.observe_hidden_states

    def recording(hs):
        for i, rid in enumerate(hs.request_ids):
            start = int(hs.context_lens[i])
            rows = hs.hidden_states[int(hs.query_start_loc[i]):int(hs.query_start_loc[i + 1])]
            seen.setdefault(rid, {}).update({start + j: rows[j].clone() for j in range(rows.shape[0])})
        observe(hs)

    llm.engine.drafter.observe_hidden_states = recording
    tok = llm.get_tokenizer()
    ids = tok(PROMPTS[0]).input_ids
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12))[0]
    full = ids + list(out.outputs[0].token_ids)
    with torch.no_grad():
        ref = _target().model(torch.tensor([full])).last_hidden_state[0]
    rows = next(iter(seen.values()))  # the last row seen at a position is its final, accepted token's
    for pos in range(len(full) - 1):  # every computed position was seen with the target's feature
        assert torch.allclose(rows[pos], ref[pos], atol=1e-4), f"position {pos}"


def test_shipped_head_acceptance(make_llm):
    """The shipped head reaches the acceptance models/README.md states (k=2, greedy); a feature or
    token off by one position drops it far below."""
    llm = make_llm(drafter="eagle", drafter_params={"model": STORIES_EAGLE, "num_speculative_tokens": 2})
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64))
    summary = llm.engine.metrics.summary()
    assert summary["spec_acceptance_rate"] > 0.45, summary["spec_acceptance_rate"]
    assert summary["spec_mean_accepted_length"] > 1.9


def test_prefix_cache_hit_starts_the_head_late(make_llm):
    """A request whose prompt hits the prefix cache gives the head no features for the cached part:
    the head starts at the first position it sees, and the output is still the target's."""
    llm = make_llm(drafter="eagle", drafter_params={"model": STORIES_EAGLE, "num_speculative_tokens": 2},
                   block_size=4)
    prompt = "Once upon a time, there was a little girl named Lily. She liked to play in the park with her"
    first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].token_ids
    starts = []
    observe = llm.engine.drafter.observe_hidden_states

    def recording(hs):
        observe(hs)
        starts.extend(s.start for s in llm.engine.drafter._states.values())

    llm.engine.drafter.observe_hidden_states = recording
    second = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].token_ids
    assert second == first
    assert starts and min(starts) > 0, "expected a prefix-cache hit to skip the cached positions"


@pytest.mark.slow
def test_eagle_with_compiled_target_keeps_parity(make_llm):
    """engine.compile=true: the hidden states come from the compiled decoder; greedy output still
    equals transformers and the head still drafts well (its features are the target's).

    Its steps verify drafts (several tokens per request), which run the opaque attention op under
    any backend; the ``torch`` backend spares compiling ``torch_paged``'s traced-decode graphs
    (~50 s of this test)."""
    from helpers import hf_greedy

    llm = make_llm(drafter="eagle", drafter_params={"model": STORIES_EAGLE, "num_speculative_tokens": 2}, compile=True,
                   attention="torch")
    assert llm.engine.runner.compile_stats.active
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PROMPTS[:4]]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 32)
    summary = llm.engine.metrics.summary()
    assert summary["spec_acceptance_rate"] > 0.45
    assert llm.engine.runner.compile_stats.num_recompiles == 0
