"""``kv_connector=offload`` under ``executor=sim`` (``plugins/executors/_sim_offload.py``): the simulated tiers hit
exactly as the real connector does on the same workload (stories260K, the oracle), hits lower the simulated TTFT
at a thrashing KV budget, loads are priced by bytes and bandwidth, and the metrics are the real engine's keys."""

from __future__ import annotations

import pytest
import torch
from helpers import STORIES

from framework import LLM, SamplingParams
from plugins.executors._sim_offload import SimulatedTiers

BLOCK = 4
ENGINE = dict(model=STORIES, dtype="float32", compile=False, block_size=BLOCK, num_blocks=16, max_model_len=64)
SIM = dict(executor="sim", executor_params={"profile": "analytic:h100", "memory": "engine"})
FIXED = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # lengths the sim reproduces
OPENINGS = ["Once upon a time there was a little girl named Lily", "Tom had a big red ball",
            "The sun was hot and the bird sang"]


def conversations(llm: LLM, turns: int = 3) -> None:
    """Three conversations interleaved (A1 B1 C1 A2 ...), one request at a time; each turn's prompt is the
    previous prompt, its output and a follow-up (tests/plugins/kv_connectors/kv_conversations.py, fixed lengths)."""
    tok = llm.engine.tokenizer
    follow = [t for t in tok(" Then she said").input_ids if t != tok.bos_token_id]
    prompts = [tok(text).input_ids for text in OPENINGS]
    for _ in range(turns):
        for i in range(len(prompts)):
            out = llm.generate([prompts[i]], FIXED)[0]
            assert out.error is None and len(out.outputs[0].token_ids) == FIXED.max_tokens
            prompts[i] = prompts[i] + list(out.outputs[0].token_ids) + follow


def block_bytes() -> int:
    return LLM(**ENGINE, **SIM).engine.executor.rank.kv_cache_bytes_per_block()


def counts(llm: LLM) -> tuple[int, int, int, int]:
    summary = llm.engine.metrics.summary()
    stats = llm.engine.scheduler.kv.stats()
    return (summary["external_prefix_cache_queries"], summary["external_prefix_cache_hits"],
            stats.prefix_queries_tokens, stats.prefix_hits_tokens)


@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_simulated_hits_equal_the_real_connectors(tmp_path, tiers):
    """The oracle: the same conversations through the real engine and the simulator hit the tiers (and the local
    prefix cache) for the same numbers of tokens; a disk tier behind a 4-block CPU tier spills, loads in the
    background and promotes in both."""
    nbytes = block_bytes()
    params = ({"cpu_bytes": 64 * nbytes} if tiers == "cpu" else
              {"cpu_bytes": 4 * nbytes + nbytes // 2, "disk_path": str(tmp_path), "disk_bytes": 40 * nbytes})
    real = LLM(**ENGINE, kv_connector="offload", kv_connector_params=params)
    store = real.engine.runner.kv_connector.connector.store
    assert sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for shape, dtype in store.layout) == nbytes
    sim = LLM(**ENGINE, **SIM, kv_connector="offload", kv_connector_params=params)
    conversations(real)
    conversations(sim)
    assert counts(sim) == counts(real)
    assert counts(sim)[1] > 0
    simulated = sim.engine.executor.offload.store
    assert (len(simulated.cpu), len(simulated.disk)) == (len(store.cpu), len(store.disk))
    assert simulated.cpu_used == store.cpu_used and simulated.disk_used == store.disk_used
    if tiers == "disk":
        assert sim.engine.executor.offload.load_bytes["disk"] > 0 and len(simulated.disk) > 4
    store.close()


def test_offload_lowers_simulated_ttft_at_a_thrashing_budget():
    """Llama-3-70B shapes, TP=8 on analytic H100s, 8 conversations of 3 turns at a KV budget of about two
    conversations: the CPU tier serves the earlier turns (external hits > 0) and the TTFT p50 drops against
    recompute; every hit token was loaded once, whole blocks of the simulated size."""
    from experiments.sim.sim_offload import run_arm

    small = dict(num_blocks=96, conversations=8, turns=3, first_len=512, output_len=32, max_model_len=1024)
    recompute = run_arm(offload=False, **small)
    offload = run_arm(offload=True, **small)
    assert recompute["external_prefix_cache_hits"] == 0 and offload["external_prefix_cache_hits"] > 0
    assert offload["ttft_p50_s"] < recompute["ttft_p50_s"]
    assert offload["offload_load_bytes"] == offload["external_prefix_cache_hits"] // 16 * offload["block_bytes"]


def test_bad_params_are_refused_before_anything_loads():
    with pytest.raises(ValueError, match="offload_cpu_bandwidth_gbps must be > 0"):
        LLM(**ENGINE, executor="sim", kv_connector="offload",
            executor_params={"profile": "analytic:h100", "offload_cpu_bandwidth_gbps": 0})
    with pytest.raises(ValueError, match="executor=sim simulates kv_connector=none|offload"):
        LLM(**ENGINE, executor="sim", kv_connector="shared_storage", executor_params={"profile": "analytic:h100"})


def test_simulated_tiers_keep_the_lru_and_byte_limits():
    tiers = SimulatedTiers(cpu_bytes=2 * 100, disk_bytes=3 * 100)

    def block():
        return [torch.empty(100, dtype=torch.uint8, device="meta")]

    for key in "abcdef":
        tiers.put(key, block())
    assert list(tiers.cpu) == ["e", "f"] and list(tiers.disk) == ["b", "c", "d"]  # "a" fell off the disk tier
    assert tiers.cpu_used == 200 and tiers.disk_used == 300
    assert tiers.get("c")[1] is True and tiers.get("a") is None
    tiers.put("c", tiers.get("c")[0])  # promotion: "c" back to CPU, "e" spills
    assert list(tiers.cpu) == ["f", "c"] and "e" in tiers.disk and "c" not in tiers.disk


def test_loads_and_saves_are_priced_by_bytes_and_bandwidth():
    """Model-free: a save and a CPU-tier load cost bytes over the CPU bandwidth in the step; a disk-tier block loads
    asynchronously on the one simulated reader and its request is reported only once the read is done, then
    promoted to the CPU tier; a block in neither tier is a load error."""
    from plugins.executors._sim_offload import SimulatedOffload
    from plugins.kv_connectors.offload import OffloadMetadata

    nbytes = 1_000_000
    sim = SimulatedOffload({"cpu_bytes": nbytes, "disk_path": "unused", "disk_bytes": 4 * nbytes}, nbytes,
                           cpu_bandwidth_gbps=8.0, disk_bandwidth_gbps=0.8)  # 1 GB/s and 0.1 GB/s
    assert sim.start_step(OffloadMetadata(saves=[(0, "a", "r0"), (1, "b", "r0")]), 0.0) == pytest.approx(2e-3)
    assert list(sim.store.cpu) == ["b"] and list(sim.store.disk) == ["a"]
    assert sim.start_step(OffloadMetadata(loads=[(2, "b", "r1")]), 1.0) == pytest.approx(1e-3)
    assert sim.start_step(OffloadMetadata(async_loads=[(3, "a", "r2"), (4, "a", "r2")]), 2.0) == 0.0
    assert sim.next_ready_s() == pytest.approx(2.02)  # two 1 MB reads at 0.1 GB/s, one after the other
    assert sim.finish_step(2.01).finished_recving is None
    out = sim.finish_step(2.02)
    assert out.finished_recving == {"r2"} and not out.invalid_block_ids and "a" in sim.store.cpu
    assert sim.load_bytes == {"cpu": nbytes, "disk": 2 * nbytes}
    sim.start_step(OffloadMetadata(loads=[(5, "zzz", "r3")]), 3.0)
    assert sim.finish_step(3.0).invalid_block_ids == {5}



PD_SMALL = dict(num_blocks=48, conversations=6, turns=3, first_len=256, turn_len=64, output_len=16, max_model_len=512)


def test_offload_under_the_simulated_pd_front_serves_the_prefill_pool():
    """P/D (one prefill, one decode replica; Llama-3-70B shapes, TP=8, analytic H100s, a thrashing KV budget) with
    ``kv_connector=offload``: the prefill replica's tier serves the earlier turns (its hits are the front's
    ``external_prefix_cache_hits``), so the prefill pool computes less than without offload; the decode replica has
    no tier (its prompts arrive by transfer)."""
    from experiments.sim.sim_offload import run_arm

    plain, offload = (run_arm(on, replicas=2, prefill_replicas=1, **PD_SMALL) for on in (False, True))
    assert plain["num_requests"] == offload["num_requests"] == 18 and offload["layout"] == "1P+1D"
    roles = [r["role"] for r in offload["replicas"]]
    assert roles == ["prefill", "decode"] and [r["role"] for r in plain["replicas"]] == roles
    prefill, decode = offload["replicas"]
    assert prefill["external_prefix_cache_hits"] > 0 and decode["external_prefix_cache_queries"] == 0
    assert offload["external_prefix_cache_hits"] == prefill["external_prefix_cache_hits"]
    assert plain["external_prefix_cache_hits"] == 0
    assert prefill["step_s"] < plain["replicas"][0]["step_s"]  # the prefill pool recomputes less
    assert offload["num_steps"] == sum(r["num_steps"] for r in offload["replicas"])  # both pools' steps count


def test_a_colocated_data_parallel_front_sums_its_replicas_external_hits():
    """Two colocated replicas with offload tiers: ``metrics.json``'s external prefix-cache counters are the replicas'
    sums (the front's own collector sees no step; before, they read 0)."""
    from experiments.sim.sim_offload import run_arm

    row = run_arm(True, replicas=2, **PD_SMALL)
    hits = [r["external_prefix_cache_hits"] for r in row["replicas"]]
    assert sum(hits) > 0 and row["external_prefix_cache_hits"] == sum(hits) and row["layout"] == "2 colocated"
    assert row["external_prefix_cache_queries"] == sum(r["external_prefix_cache_queries"] for r in row["replicas"])
