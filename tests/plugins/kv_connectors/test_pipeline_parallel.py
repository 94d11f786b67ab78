"""KV connectors under ``executor=mp pipeline_parallel_size=2``: stories260K's 5 layers as stages 0-2 | 3-4, each
stage's worker side moving only its own layers' part of every block, every stage's report merged by the executor.
A ``shared_storage`` producer run then a consumer run, and ``offload`` turns that hit both tiers, are float32
greedy token-exact against one plain engine; the folder holds one file per stage per block, named with the stage's
layers, and a consumer of another layout (one stage, or another ``pp_layer_partition``) loads none of them: it
recomputes, and says why once."""

from __future__ import annotations

import logging

import pytest
import torch
from kv_conversations import TIGHT, assert_no_leak, conversations, greedy_run

from framework import LLM
from framework.config import EngineConfig
from framework.engine.kv_transfer_support import kv_transfer_problems
from framework.interfaces.kv_connector import KVShard

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

PP2 = dict(executor="mp", pipeline_parallel_size=2)
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play",
           "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block
STAGE_TAGS = ("pp0of2.layers0-3", "pp1of2.layers3-5")  # vLLM's split of 5 layers: 3 | 2


def _record_merges(llm):
    """Per step, how many ranks' worker-side reports the executor merged and the merged report (filled as the
    engine runs)."""
    merged, aggregate = [], llm.engine.executor.kv_outputs.aggregate

    def record(outputs):
        out = aggregate(outputs)
        merged.append((sum(o is not None for o in outputs), out))
        return out

    llm.engine.executor.kv_outputs.aggregate = record
    return merged


@pytest.fixture(scope="module")
def plain():
    return greedy_run(PROMPTS)[0]


def test_shared_storage_pp2_producer_then_consumer_is_exact_and_keyed_by_stage(tmp_path, plain, caplog):
    params = {"kv_connector": "shared_storage", "kv_connector_params": {"path": str(tmp_path)}}
    assert greedy_run(PROMPTS, **PP2, **params, kv_role="kv_producer") == (plain, 0)
    stored = [sorted(p.name.split(".")[0] for p in tmp_path.glob(f"*.{tag}.safetensors")) for tag in STAGE_TAGS]
    assert stored[0] and stored[0] == stored[1], "every block must be stored once per stage"
    assert len(list(tmp_path.iterdir())) == 2 * len(stored[0]), "a PP=2 producer wrote a file of another layout"
    tokens, hits = greedy_run(PROMPTS, **PP2, **params, kv_role="kv_consumer")
    assert tokens == plain and hits > 0
    with caplog.at_level(logging.WARNING, logger="plugins.kv_connectors.shared_storage"):
        assert greedy_run(PROMPTS, **params, kv_role="kv_consumer") == (plain, 0)  # one stage: recomputes everything
    assert "pipeline_parallel_size" in caplog.text and STAGE_TAGS[1] in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plugins.kv_connectors.shared_storage"):  # other layers per stage
        assert greedy_run(PROMPTS, **PP2, pp_layer_partition="4,1", **params, kv_role="kv_consumer") == (plain, 0)
    assert caplog.text.count("pp_layer_partition") == 1  # once per engine, the fix named


def test_offload_pp2_turns_hit_both_tiers_and_every_stage_drops_the_same_blocks(tmp_path):
    """Tiers of 2.5 and 12 whole blocks, far below three conversations' working set: blocks spill to disk (loaded
    asynchronously, the request parked until both stages report) and are dropped. Stage 0 holds 3 layers, stage 1
    two; each gets its layers' share of the limits, so both keep and drop the same blocks: every drop reaches the
    scheduler side (both stages reported it) and no load fails. While a request is parked the engine sends steps
    that schedule nothing, and stage 0 answers them a step ahead of stage 1: ``executor=mp`` must keep those replies
    for their own step (it lost them and hung before)."""
    plain_llm = LLM(**TIGHT)
    runner = plain_llm.engine.runner
    block_bytes = torch.empty(runner.backend.get_kv_cache_shape(1)).nbytes * len(runner.kv_caches)
    expected = conversations(plain_llm)
    llm = LLM(**TIGHT, **PP2, kv_connector="offload", kv_connector_params=dict(
        cpu_bytes=2 * block_bytes + block_bytes // 2, disk_path=str(tmp_path), disk_bytes=12 * block_bytes))
    try:
        merged = _record_merges(llm)
        assert conversations(llm) == expected
        assert llm.engine.metrics.summary()["external_prefix_cache_hits"] > 0
        assert {n for n, _ in merged} == {2}, "every step must merge both stages' reports"
        assert not any(o.invalid_block_ids for _, o in merged if o is not None), "a stage lost a block the other kept"
        events = [e[0] for _, o in merged if o is not None for e in o.kv_cache_events or ()]
        assert "disk" in events and "removed" in events
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


def test_a_stage_gets_its_layers_share_of_the_byte_limits():
    """Stage 0 holds 3 of 5 layers, stage 1 two: per rank ``limit x layers / (5 x tp)``, so every rank's tier
    holds ``floor(limit / whole block)`` blocks of its own size."""
    stages = ((0, 3), (3, 5))
    per_layer = 64  # bytes of one layer's part of a block on one rank
    for limit in (1000, 64 * 5 * 7 + 63, 1 << 20):
        counts = {KVShard(t, 2, s, stages).share_bytes(limit) // ((b - a) * per_layer)
                  for s, (a, b) in enumerate(stages) for t in range(2)}
        assert counts == {limit // (5 * 2 * per_layer)}


def test_what_stays_refused_names_the_fix(tmp_path):
    def problems(connector="shared_storage", **kwargs):
        return kv_transfer_problems(EngineConfig(model="m", kv_connector=connector,
                                                 kv_connector_params={"path": str(tmp_path)}, **kwargs))

    assert problems(**PP2) == [] and problems(executor="ray", pipeline_parallel_size=2, tensor_parallel_size=2) == []
    assert any("pipeline_parallel_size=1" in p for p in problems("zmq", **PP2))
    assert any("executor=mp" in p for p in problems("zmq", executor="ray"))
