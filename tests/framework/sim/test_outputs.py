"""Synthetic outputs of a simulated model: lengths, EOS, grammar-valid tokens, draft acceptance."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.sim.outputs import LOW_TOKEN_ID, AcceptanceModel, SyntheticSampler


def _request(**params) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(**params), eos_token_ids=frozenset({2}))


def test_tokens_never_eos_without_an_eos_probability_and_stay_in_the_vocabulary():
    sampler = SyntheticSampler(vocab_size=50, seed=0)
    tokens = [sampler.token(_request(max_tokens=10), i) for i in range(2000)]
    assert 2 not in tokens and min(tokens) >= LOW_TOKEN_ID and max(tokens) < 50
    assert len(set(tokens)) > 40  # spread over the vocabulary


def test_eos_probability_gives_geometric_lengths_after_min_tokens_unless_ignored():
    sampler = SyntheticSampler(vocab_size=1000, seed=1, eos_probability=0.2)
    request = _request(max_tokens=100, min_tokens=3)
    draws = [[sampler.token(request, i) == 2 for i in range(6)] for _ in range(3000)]
    assert not any(d[i] for d in draws for i in range(3))  # no EOS before min_tokens
    assert abs(np.mean([d[4] for d in draws]) - 0.2) < 0.03
    ignoring = _request(max_tokens=100, ignore_eos=True)
    assert 2 not in [sampler.token(ignoring, 10) for _ in range(500)]


def test_allowed_token_draws_only_set_bits():
    sampler = SyntheticSampler(vocab_size=70, seed=2)
    row = np.zeros(3, dtype=np.int32)
    for token in (4, 33, 65):
        row[token // 32] |= np.int32(1 << (token % 32)) if token % 32 != 31 else np.int32(-(2**31))
    assert {sampler.allowed_token(row) for _ in range(300)} == {4, 33, 65}
    with pytest.raises(ValueError, match="allows no token"):
        sampler.allowed_token(np.zeros(3, dtype=np.int32))


def test_overall_rate_is_what_a_run_reports():
    for rate, k in ((0.3, 2), (0.6, 4), (0.9, 3)):
        model = AcceptanceModel.from_overall_rate(rate, k)
        assert model.expected_rate(k) == pytest.approx(rate, abs=1e-6)
        rng = random.Random(0)
        accepted = [model.num_accepted(k, rng) for _ in range(20000)]
        assert np.mean(accepted) / k == pytest.approx(rate, abs=0.015)


def test_per_position_rates_and_params(tmp_path):
    model = AcceptanceModel([1.0, 0.0])
    assert model.num_accepted(4, random.Random(0)) == 1  # position 0 always, position 1 never
    assert AcceptanceModel.from_param({"ngram": [0.5]}, "ngram", 2).rates == [0.5]
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"spec_acceptance_by_position": [0.8, 0.6, 0.4]}))
    assert AcceptanceModel.from_param(str(metrics), "eagle", 3).rates == [0.8, 0.6, 0.4]
    with pytest.raises(ValueError, match="needs executor.params.acceptance"):
        AcceptanceModel.from_param(None, "ngram", 2)
    with pytest.raises(ValueError, match="no entry for drafter 'eagle'"):
        AcceptanceModel.from_param({"ngram": 0.5}, "eagle", 2)
    with pytest.raises(ValueError, match="probabilities"):
        AcceptanceModel([1.5])
