"""P/D disaggregation under ``executor=sim`` (``plugins/executors/_sim_disagg.py``): every request finishes with
the colocated run's tokens, TTFT pays prefill + transfer + the decode replica's first step (a hand-computed case),
and a slower link means a later first token."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import STORIES
from sim_helpers import linear_profile

from framework import build_engine
from framework.config import EngineConfig
from framework.core.sampling_params import SamplingParams
from framework.entrypoints.offline_runner import run_workload
from framework.workloads.item import WorkloadItem
from plugins.executors._sim_disagg import build_disaggregated_sim_engine, transfer_s

# stories260K's K/V per token: 5 layers x (K + V) x 4 KV heads x head_dim 8 x 4 bytes (float32)
STORIES_KV_BYTES_PER_TOKEN = 5 * 2 * 4 * 8 * 4
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def _config(tmp_path, **knobs) -> EngineConfig:
    profile = linear_profile(tmp_path / "profile.json", 0.05, prefill_tokens=0.002)
    return EngineConfig(model=STORIES, executor="sim", compile=False, executor_params={"profile": profile}, **knobs)


def _items(n: int = 8) -> list[WorkloadItem]:
    return [WorkloadItem(f"r{i}", prompt_token_ids=list(range(3, 13 + 3 * i)), max_tokens=2 + i % 5,
                         arrival_time_s=0.03 * i) for i in range(n)]


def test_a_hand_computed_request_pays_prefill_transfer_and_one_decode_step(tmp_path):
    """Prompt 10, 3 tokens: prefill 0.05 + 10 x 0.002 s; transfer 0.01 s + 10 x 1280 B x 8 / 1 Mbit/s; then the
    decode replica computes the last prompt token only (0.05 s, the first token) and two more decodes."""
    link = {"bandwidth_gbps": 1e-3, "latency_s": 0.01}
    engine = build_disaggregated_sim_engine(_config(tmp_path, data_parallel_size=2, disagg_prefill_replicas=1,
                                                    kv_transfer_link_params=link))
    assert engine.kv_bytes_per_token == STORIES_KV_BYTES_PER_TOKEN
    item = WorkloadItem("a", prompt_token_ids=list(range(3, 13)), max_tokens=3)
    records, summary = run_workload(engine, [item], GREEDY, progress=False)
    transfer = 0.01 + 10 * STORIES_KV_BYTES_PER_TOKEN * 8 / 1e6
    assert transfer_s(10, STORIES_KV_BYTES_PER_TOKEN, 1e-3, 0.01) == pytest.approx(transfer)
    metrics = records[0]["metrics"]
    assert metrics["ttft_s"] == pytest.approx(0.07 + transfer + 0.05)
    assert metrics["e2e_s"] == pytest.approx(0.07 + transfer + 3 * 0.05)
    assert len(records[0]["token_ids"]) == 3 and summary["num_requests"] == 1
    engine.shutdown()


def test_every_request_finishes_with_the_colocated_runs_tokens(tmp_path):
    config = _config(tmp_path, data_parallel_size=3)
    colocated = build_engine(config)
    reference, _ = run_workload(colocated, _items(), GREEDY, progress=False)
    colocated.shutdown()
    engine = build_disaggregated_sim_engine(dataclasses.replace(config, disagg_prefill_replicas=1))
    records, summary = run_workload(engine, _items(), GREEDY, progress=False)
    assert summary["num_requests"] == len(reference) == 8 and engine.num_transfers == 8
    assert [len(r["token_ids"]) for r in records] == [len(r["token_ids"]) for r in reference]
    assert all(r["finish_reason"] == "length" for r in records)
    assert not engine.has_unfinished_requests()
    engine.shutdown()


def test_a_slower_link_delays_the_first_token(tmp_path):
    ttfts = []
    for bandwidth in (1000.0, 1e-2, 1e-3):
        config = _config(tmp_path, data_parallel_size=2, disagg_prefill_replicas=1,
                         kv_transfer_link_params={"bandwidth_gbps": bandwidth})
        engine = build_disaggregated_sim_engine(config)
        _, summary = run_workload(engine, _items(), GREEDY, progress=False)
        ttfts.append(summary["mean_ttft_ms"])
        engine.shutdown()
    assert ttfts[0] < ttfts[1] < ttfts[2]


def test_bad_link_params_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="bandwidth_gbps must be > 0"):
        build_disaggregated_sim_engine(_config(tmp_path, data_parallel_size=2, disagg_prefill_replicas=1,
                                               kv_transfer_link_params={"bandwidth_gbps": 0}))
    with pytest.raises(ValueError, match="unknown kv_transfer.params"):
        build_disaggregated_sim_engine(_config(tmp_path, data_parallel_size=2, disagg_prefill_replicas=1,
                                               kv_transfer_link_params={"bandwith_gbps": 1}))
    with pytest.raises(ValueError, match="disagg.prefill_replicas must be 0"):
        _config(tmp_path, data_parallel_size=2, disagg_prefill_replicas=2)


def test_build_engine_builds_the_pd_front_under_sim(tmp_path):
    """``framework.build_engine`` (``run.py``, ``LLM``) with ``executor=sim`` and ``disagg.prefill_replicas``."""
    from plugins.executors._sim_disagg import DisaggregatedSimEngine

    engine = build_engine(_config(tmp_path, data_parallel_size=3, disagg_prefill_replicas=1))
    assert isinstance(engine, DisaggregatedSimEngine)
    assert (len(engine.prefill.replicas), len(engine.decode.replicas)) == (1, 2)
    records, _ = run_workload(engine, _items(3), GREEDY, progress=False)
    assert engine.num_transfers == 3 and all(r["finish_reason"] == "length" for r in records)
    engine.shutdown()
