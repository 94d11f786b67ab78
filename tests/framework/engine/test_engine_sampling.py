"""Stops, logprobs and sampling through the whole engine on stories260K."""

from __future__ import annotations

import torch
from helpers import STORIES

from framework import SamplingParams

PROMPT = "Once upon a time"


def _greedy_ids(llm, n=40):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids


def test_stop_string_trimmed_and_included(make_llm):
    llm = make_llm()
    full = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0].text
    stop = "Lily"
    assert stop in full
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    out2 = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert out2.text == full[:full.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(make_llm):
    llm = make_llm()
    ids = _greedy_ids(llm)
    target = ids[5]
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == ids[:ids.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_list_ignore_eos_and_min_tokens(make_llm):
    llm = make_llm()
    assert llm.engine.eos_token_ids == {1, 2}  # generation_config lists [2, 1]; stories end with BOS
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=400))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in (1, 2)
    n = len(out.token_ids)
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == n + 5 and ignored.finish_reason == "length"
    forced = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n + 2))[0].outputs[0]
    assert len(forced.token_ids) >= n + 2 and all(t not in (1, 2) for t in forced.token_ids[:n + 1])


def test_max_model_len_stops_with_length(make_llm):
    llm = make_llm(max_model_len=20)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 20
    assert out.outputs[0].finish_reason == "length"


def test_logprobs(make_llm):
    llm = make_llm()
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) in (3, 4)
        assert lp[tok] == max(lp.values()) and all(v <= 0 for v in lp.values())


def test_seeded_sampling_reproducible_and_batch_independent(make_llm):
    llm = make_llm()
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    batched = llm.generate(["The dog", PROMPT, "Lily"], [SamplingParams(temperature=1.0, max_tokens=20), p,
                                                          SamplingParams(temperature=0.7, max_tokens=9)])
    assert batched[1].outputs[0].token_ids == alone
    other = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20,
                                                ignore_eos=True))[0].outputs[0].token_ids
    assert other != alone


def test_first_token_distribution_matches_transformers(make_llm):
    """Chi-square test of 2,000 seeded first-token samples against softmax of transformers' logits."""
    from transformers import AutoModelForCausalLM

    llm = make_llm(max_num_seqs=512)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    n = 2000
    outs = llm.generate([{"prompt_token_ids": ids}] * n,
                        [SamplingParams(temperature=1.0, max_tokens=1, seed=s) for s in range(n)])
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[0] for o in outs]), minlength=512).double()
    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
    expected = probs * n
    keep = expected >= 5  # pool rare tokens into one bin
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = int(keep.sum())
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, f"chi2={chi2:.1f} with {dof} dof"
