"""Tree verification in ``framework.sample.rejection_sampler`` on synthetic distributions (no model): greedy takes
the longest matching root-to-node path (not the first matching branch), the emitted rows are the path's, and random
verification over a tree (SpecInfer's multi-step sampling with deterministic candidates) emits two-token sequences
with exactly the target's joint distribution."""

from __future__ import annotations

import collections
import itertools

import torch

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.sample.rejection_sampler import RejectionSampler
from framework.sample.sampler import Sampler

VOCAB = 5


def _req(rid: str, **kw) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(**kw))


def test_greedy_takes_the_longest_matching_path():
    # nodes: 0 tok 3 (root child), 1 tok 3 (root child, duplicate), 2 tok 1 (child of 1), 3 tok 4 (child of 0)
    drafts, parents = [3, 3, 1, 4], [-1, -1, 1, 0]
    logits = torch.full((5, VOCAB), -5.0)
    logits[0, 3] = 5.0  # root row: 3 -> nodes 0 and 1 both match
    logits[1, 2] = 5.0  # node 0's row: 2 (node 3's token 4 does not match)
    logits[2, 1] = 5.0  # node 1's row: 1 -> node 2 matches
    logits[3, 0] = 5.0  # node 2's row: the bonus token 0
    logits[4, 2] = 5.0
    out = RejectionSampler(Sampler(VOCAB))(logits, [_req("a", temperature=0.0, logprobs=0)], [drafts],
                                           draft_parents=[parents])
    assert out.token_ids == [[3, 1, 0]] and out.num_accepted == [2] and out.accepted_nodes == [[1, 2]]
    # the logprobs are those of rows 0, 2 and 3 (the path's), each with its emitted token
    assert [set(lp) for lp in out.logprobs[0]] == [{3}, {1}, {0}]


def test_greedy_chain_and_tree_requests_in_one_call():
    logits = torch.full((5, VOCAB), -5.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = 5.0  # chain request: drafts [2, 3] -> accepts 2, then 4
    logits[3, 0] = logits[4, 3] = 5.0  # tree request (one node, token 0): accepted, bonus 3
    out = RejectionSampler(Sampler(VOCAB))(logits, [_req("c", temperature=0.0), _req("t", temperature=0.0)],
                                           [[2, 3], [0]], draft_parents=[None, [-1]])
    assert out.token_ids == [[2, 4], [0, 3]] and out.accepted_nodes == [None, [0]]


def test_tree_sampling_keeps_the_joint_distribution():
    """Root children [1, 2, 3] (two of them children of their own), all deterministic: the first two emitted tokens
    follow p(t0) * p(t1 | t0) (total variation < 0.02 over 30,000 draws)."""
    torch.manual_seed(0)
    drafts, parents = [1, 2, 3, 0, 4], [-1, -1, -1, 0, 0]
    rows = torch.randn(6, VOCAB) * 1.5  # row 0: root; row i + 1: node i
    second = {1: 1, 2: 2, 3: 3}  # the row (1 + node) that predicts after a root child's token
    rs = RejectionSampler(Sampler(VOCAB))
    n, counts = 30000, collections.Counter()
    for i in range(n):
        out = rs(rows.clone(), [_req(str(i), temperature=1.0, seed=i)], [drafts], draft_parents=[parents])
        tokens = out.token_ids[0]
        if len(tokens) == 1:  # no root child accepted: t1 would come from a later step, drawn from p(. | t0)
            t0 = tokens[0]
            t1 = int(torch.multinomial(_p_after(rows, second, t0), 1, generator=torch.Generator().manual_seed(i)))
            tokens = [t0, t1]
        counts[tuple(tokens[:2])] += 1
    p0 = rows[0].softmax(-1)
    tv = 0.0
    for t0, t1 in itertools.product(range(VOCAB), repeat=2):
        tv += abs(counts[(t0, t1)] / n - float(p0[t0] * _p_after(rows, second, t0)[t1]))
    assert tv / 2 < 0.02


def _p_after(rows, second, t0):
    """The target's next-token distribution after the root token ``t0`` (a node's row when ``t0`` is a root child's
    token; any fixed row otherwise: the test only needs a well-defined conditional)."""
    return rows[second.get(t0, 5)].softmax(-1)
