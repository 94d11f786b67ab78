"""Unit tests of ``framework.sample.rejection_sampler`` on synthetic distributions (no model)."""

from __future__ import annotations

import collections

import torch

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.sample.rejection_sampler import RejectionSampler
from framework.sample.sampler import Sampler

VOCAB = 6


def _req(rid: str, **kw) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(**kw))


def test_greedy_accepts_matching_prefix_and_adds_target_token():
    rs = RejectionSampler(Sampler(VOCAB))
    logits = torch.full((3, VOCAB), -5.0)
    logits[0, 3] = logits[1, 4] = logits[2, 5] = 5.0  # target argmax: 3, 4, 5
    out = rs(logits, [_req("a", temperature=0.0)], [[3, 0]])
    assert out.token_ids == [[3, 4]] and out.num_accepted == [1]
    out = rs(logits, [_req("b", temperature=0.0)], [[3, 4]])
    assert out.token_ids == [[3, 4, 5]] and out.num_accepted == [2]  # bonus token
    out = rs(logits, [_req("c", temperature=0.0, logprobs=1)], [[0, 4]])
    assert out.token_ids == [[3]] and out.num_accepted == [0]
    assert set(out.logprobs[0][0]) == {3}


def test_rejection_sampling_with_draft_probabilities_keeps_p():
    """Leviathan et al. 2023, Sec. 2.3: with any q, the first emitted token is distributed as p."""
    torch.manual_seed(0)
    p_logits = torch.randn(2, VOCAB)
    q = torch.randn(1, VOCAB).softmax(-1)
    rs = RejectionSampler(Sampler(VOCAB))
    n = 20000
    counts = collections.Counter()
    gen = torch.Generator().manual_seed(1)
    for i in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        out = rs(p_logits.clone(), [_req(str(i), temperature=1.0, seed=i)], [[draft]], draft_probs=[q])
        counts[out.token_ids[0][0]] += 1
    p = p_logits[0].softmax(-1)
    empirical = torch.tensor([counts[t] / n for t in range(VOCAB)])
    assert (empirical - p).abs().sum() / 2 < 0.02  # total variation


def test_penalties_see_earlier_drafts():
    """Row j of a verify sees output + drafts[:j]: a huge presence penalty forbids repeating a draft."""
    rs = RejectionSampler(Sampler(VOCAB))
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 3.0
    logits[:, 2] = 2.0
    out = rs(logits, [_req("a", temperature=0.0, presence_penalty=2.0)], [[4]])
    assert out.token_ids == [[4, 2]]  # row 1 penalises the accepted draft 4
