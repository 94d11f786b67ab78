"""Rejection sampling keeps the target distribution (Leviathan et al. 2023, Sec. 2.3).

Thousands of seeded requests at temperature 1 on stories260K; the joint distribution of the first
three output tokens (with ``max_tokens=4`` the second and third come from verifying up to two
drafts, incl. bonus tokens) is compared with the exact target joint ``p(t0) p(t1|t0) p(t2|t0,t1)`` computed with transformers, by a chi-square
test (bins with expected count >= 5, the rest pooled; threshold df + 5 sqrt(2 df), about 5 sigma).
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE

from framework import SamplingParams, hookimpl, registry

PROMPT = "Lily and Tom went to the park. Lily and Tom went to the park. Lily and Tom"
NUM_SAMPLES = 3000


def _exact_joint(prompt_ids: list[int]) -> dict[tuple[int, ...], float]:
    """Exact target probabilities of the first three output tokens (triples above 1e-6)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    prompt = torch.tensor([prompt_ids])
    with torch.inference_mode():
        p0 = model(prompt).logits[0, -1].softmax(-1)
        vocab = p0.shape[0]
        seqs = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        joint2 = p0[:, None] * model(seqs).logits[:, -1].softmax(-1)  # (vocab, vocab)
        pairs = (joint2 > 1e-5).nonzero()  # (num_pairs, 2)
        seqs = torch.cat([prompt.repeat(len(pairs), 1), pairs], dim=1)
        p2 = model(seqs).logits[:, -1].softmax(-1)  # (num_pairs, vocab)
    joint3 = joint2[pairs[:, 0], pairs[:, 1]][:, None] * p2
    out = {}
    for row, t2 in (joint3 > 1e-6).nonzero().tolist():
        out[(*pairs[row].tolist(), t2)] = float(joint3[row, t2])
    return out


def _chi_square(counts: collections.Counter, exact: dict[tuple[int, int], float], n: int) -> tuple[float, int]:
    """Pearson chi-square statistic and its bin count over bins with expected >= 5 (+ a pooled bin)."""
    stat, df, pooled_obs, pooled_exp = 0.0, 0, n, float(n)
    for key, p in exact.items():
        expected = n * p
        if expected >= 5:
            stat += (counts.get(key, 0) - expected) ** 2 / expected
            df += 1
            pooled_obs -= counts.get(key, 0)
            pooled_exp -= expected
    stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
    return stat, df


class _BadDrafter(registry.KINDS["drafter"][1]):
    """Always proposes the same token: nearly every draft is rejected."""

    name = "always_same"

    def propose(self, requests):
        return {r.request_id: [7] * self.num_speculative_tokens for r in requests}


class _BadPlugin:
    @hookimpl
    def register_drafters(self, register):
        register("always_same", _BadDrafter)


@pytest.mark.parametrize("drafter", ["none", "ngram", "draft_model", "eagle", "always_same"])
def test_rejection_sampling_keeps_target_distribution(make_llm, drafter):
    params = {} if drafter == "none" else {"num_speculative_tokens": 3}
    if drafter in ("draft_model", "eagle"):
        params["model"] = STORIES_DRAFT if drafter == "draft_model" else STORIES_EAGLE
    with registry.registered(_BadPlugin()):
        llm = make_llm(drafter=drafter, drafter_params=params)
    ids = llm.get_tokenizer()(PROMPT).input_ids
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1000 + i) for i in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": ids}] * NUM_SAMPLES, params)
    counts = collections.Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
    stat, df = _chi_square(counts, _exact_joint(ids), NUM_SAMPLES)
    assert df > 10, "too few bins for a meaningful test"
    assert stat < df + 5 * math.sqrt(2 * df), f"chi-square {stat:.1f} with {df} dof: not the target distribution"
    if drafter != "none":
        summary = llm.engine.metrics.summary()
        assert summary["spec_num_draft_tokens"] > 0.1 * NUM_SAMPLES, "drafts were not verified"
        if drafter == "always_same":
            assert summary["spec_acceptance_rate"] < 0.2


def test_seeded_speculative_sampling_is_reproducible(make_llm):
    llm = make_llm(drafter="ngram", drafter_params={"num_speculative_tokens": 2})
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=s) for s in (1, 2, 1)]
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, params)]
    again = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 3, params)]
    assert outs == again
    assert outs[0] == outs[2]
