"""Medusa's typical acceptance (``framework/sample/typical_acceptance.py``) on synthetic distributions (no model):
the threshold is ``min(epsilon, delta * exp(-H))``, the longest accepted path wins, chains verify as one-branch trees,
greedy requests are unchanged, and the parameters are checked."""

from __future__ import annotations

import math

import pytest
import torch

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.sample.rejection_sampler import RejectionSampler
from framework.sample.sampler import Sampler
from framework.sample.typical_acceptance import TypicalAcceptance, acceptance_from_params

VOCAB = 5


def _req(rid: str, **kw) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(**kw))


def _typical_sampler(**kw) -> RejectionSampler:
    rs = RejectionSampler(Sampler(VOCAB))
    rs.typical = TypicalAcceptance(**kw)
    return rs


def test_threshold_is_min_of_epsilon_and_entropy_term():
    uniform = torch.full((1, VOCAB), 1.0 / VOCAB)  # H = ln 5: delta * exp(-H) = delta / 5
    peaked = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]])  # H = 0: delta
    rule = TypicalAcceptance(epsilon=0.09, delta=0.3)
    assert rule.thresholds(uniform).item() == pytest.approx(0.06)
    assert rule.thresholds(peaked).item() == pytest.approx(0.09)


def test_longest_accepted_path_wins_and_bonus_comes_from_its_last_node():
    # nodes: 0 tok 1 (root child), 1 tok 2 (root child), 2 tok 3 (child of 1), 3 tok 0 (child of 0)
    drafts, parents = [1, 2, 3, 0], [-1, -1, 1, 0]
    p = torch.full((5, VOCAB), 0.01)
    p[0, 1] = p[0, 2] = 0.48  # root row: both root children pass
    p[1, 4] = 0.96  # node 0's row: node 3's token 0 (0.01) fails
    p[2, 3] = 0.96  # node 1's row: node 2's token 3 passes
    p[3, 4] = 0.96  # node 2's row: the next token is drawn here
    logits = torch.log(p / p.sum(1, keepdim=True))
    out = _typical_sampler()(logits, [_req("a", temperature=1.0, seed=0)], [drafts], draft_parents=[parents])
    assert out.accepted_nodes == [[1, 2]] and out.token_ids[0][:2] == [2, 3] and out.num_accepted == [2]


def test_chain_is_one_branch_and_greedy_is_unchanged():
    logits = torch.full((3, VOCAB), -5.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = 5.0  # argmax 2, then 4: drafts [2, 3] accept one
    rs = _typical_sampler()
    greedy = rs(logits.clone(), [_req("g", temperature=0.0)], [[2, 3]])
    assert greedy.token_ids == [[2, 4]] and greedy.accepted_nodes == [None]
    random = rs(logits.clone(), [_req("r", temperature=1.0, seed=1)], [[2, 3]])
    assert random.num_accepted == [1] and random.token_ids[0][0] == 2 and random.accepted_nodes == [None]


def test_typical_accepts_a_likely_token_exact_sometimes_rejects():
    """p(draft) = 0.6 passes the threshold every time; exact rejection sampling rejects it about 40% of the time."""
    p = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1], [0.2] * 5])
    logits = torch.log(p)
    typical, exact = _typical_sampler(), RejectionSampler(Sampler(VOCAB))
    n = 400
    acc_t = sum(typical(logits.clone(), [_req(str(i), temperature=1.0, seed=i)], [[0]]).num_accepted[0]
                for i in range(n))
    acc_e = sum(exact(logits.clone(), [_req(str(i), temperature=1.0, seed=i)], [[0]]).num_accepted[0]
                for i in range(n))
    assert acc_t == n and acc_e < 0.75 * n


def test_params():
    assert acceptance_from_params({}) is None and acceptance_from_params({"acceptance": "exact"}) is None
    assert acceptance_from_params({"acceptance": "typical"}) == TypicalAcceptance(0.09, 0.3)
    assert acceptance_from_params({"acceptance": "typical", "epsilon": 0.25}) == TypicalAcceptance(0.25, 0.5)
    assert acceptance_from_params({"acceptance": "typical", "delta": 0.1}).delta == pytest.approx(0.1)
    with pytest.raises(ValueError, match="acceptance"):
        acceptance_from_params({"acceptance": "lossy"})
    with pytest.raises(ValueError, match="epsilon"):
        acceptance_from_params({"acceptance": "typical", "epsilon": 0.0})
    assert math.isclose(TypicalAcceptance().delta, 0.3)
