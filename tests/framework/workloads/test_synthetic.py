"""Synthetic scheduling/KV workloads, arrival processes and the theoretical prefix hit rate."""

from __future__ import annotations

import statistics

import pytest

from framework.workloads.synthetic import (
    apply_arrivals,
    long_tail_workload,
    multi_turn_workload,
    shared_prefix_workload,
    theoretical_hit_rate,
    validate_arrivals,
)
from framework.workloads.workload import WorkloadItem, build_workload


def test_shared_prefix_groups_and_theoretical_hit_rate():
    items = shared_prefix_workload(3, 4, prefix_len=32, question_len=8, output_len=4, seed=0, vocab_size=100)
    assert len(items) == 12 and items == shared_prefix_workload(3, 4, 32, 8, 4, seed=0, vocab_size=100)
    groups = {tuple(it.prompt_token_ids[:32]) for it in items}
    assert len(groups) == 3
    # every request after the first of its group can reuse the 32-token prefix (block-aligned at 16)
    assert theoretical_hit_rate(items, 16) == pytest.approx(3 * 3 * 32 / (12 * 40))
    assert theoretical_hit_rate(items, 64) == 0.0  # no whole 64-token block is shared


def test_multi_turn_extends_the_previous_prompt_and_spaces_turns():
    items = multi_turn_workload(2, 3, first_len=10, turn_len=4, output_len=5, turn_gap_s=2.0, seed=1, vocab_size=50)
    conv0 = [it for it in items if it.request_id.startswith("conv0")]
    for prev, nxt in zip(conv0, conv0[1:]):
        assert nxt.prompt_token_ids[:len(prev.prompt_token_ids)] == prev.prompt_token_ids
        assert len(nxt.prompt_token_ids) == len(prev.prompt_token_ids) + 9
        assert nxt.arrival_time_s == prev.arrival_time_s + 2.0


def test_long_tail_is_skewed_and_clipped():
    items = long_tail_workload(2000, seed=0, vocab_size=100, max_model_len=8192)
    lens = sorted(len(it.prompt_token_ids) for it in items)
    assert 100 <= statistics.median(lens) <= 160
    assert 2500 <= lens[int(0.99 * len(lens))] <= 6500
    clipped = long_tail_workload(200, seed=0, vocab_size=100, max_model_len=512)
    assert all(len(it.prompt_token_ids) + it.max_tokens <= 512 for it in clipped)


def _items(n):
    return [WorkloadItem(request_id=str(i), prompt_token_ids=[5]) for i in range(n)]


@pytest.mark.parametrize("arrival,burstiness", [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_arrival_processes_have_the_requested_mean_rate(arrival, burstiness):
    items = apply_arrivals(_items(4000), {"request_rate": 8.0, "arrival": arrival, "burstiness": burstiness}, seed=0)
    times = [it.arrival_time_s for it in items]
    assert times == sorted(times)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.1)
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)  # gamma(k): cv = 1/sqrt(k)
    assert cv == pytest.approx(burstiness ** -0.5 if arrival == "gamma" else 1.0, rel=0.15)


def test_trace_sets_arrivals_and_bad_traces_fail(tmp_path):
    good = tmp_path / "trace.txt"
    good.write_text("0\n0.5\n0.5\n2\n")
    items = apply_arrivals(_items(3), {"trace": str(good)}, seed=0)
    assert [it.arrival_time_s for it in items] == [0.0, 0.5, 0.5]
    for body, match in (("1\n0.5\n", "not sorted"), ("-1\n2\n", "negative")):
        bad = tmp_path / "bad.txt"
        bad.write_text(body)
        with pytest.raises(ValueError, match=match):
            validate_arrivals({"trace": str(bad)})
    with pytest.raises(ValueError, match="2 times for 3 requests"):
        short = tmp_path / "short.json"
        short.write_text("[0, 1]")
        apply_arrivals(_items(3), {"trace": str(short)}, seed=0)


@pytest.mark.parametrize("cfg,match", [({"request_rate": 0}, "request_rate must be > 0"),
                                       ({"request_rate": -2.0}, "request_rate must be > 0"),
                                       ({"arrival": "uniform"}, "poisson|gamma"),
                                       ({"burstiness": 0}, "burstiness")])
def test_bad_arrival_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        validate_arrivals(cfg)


def test_build_workload_dispatches_new_workloads():
    class Tok:
        vocab_size = 64

    cfg = {"name": "shared_prefix", "num_prefixes": 2, "questions_per_prefix": 2, "prefix_len": 8,
           "question_len": 2, "output_len": 3, "seed": 0, "request_rate": 100.0}
    items = build_workload(cfg, Tok())
    assert len(items) == 4 and all(it.arrival_time_s > 0 for it in items)
    lt = build_workload({"name": "long_tail", "num_prompts": 5, "seed": 0}, Tok(), max_model_len=64)
    assert all(len(it.prompt_token_ids) + it.max_tokens <= 64 for it in lt)
