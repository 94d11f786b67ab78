"""KV connectors under ``executor=mp tensor_parallel_size=2``: one worker side per rank, each moving its own KV heads'
shard (stories260K: 4 KV heads, 2 per rank), their reports merged by the executor. A ``shared_storage`` producer
run then a consumer run, and ``offload`` turns that hit the CPU tier, are float32 greedy token-exact against one
plain engine; the folder holds one file per rank per block, and a TP=1 consumer neither loads a TP=2 producer's
shards nor mixes them (it recomputes, and says why once)."""

from __future__ import annotations

import logging

import pytest
import torch
from kv_conversations import ENGINE, GREEDY, MODEL, TIGHT, assert_no_leak, conversations

from framework import LLM
from framework.engine.kv_transfer_support import kv_transfer_problems
from framework.testing import check_kv_connector
from framework.testing.kv_connector_engine import check_kv_connector_engine
from plugins.attention.torch_paged import TorchPagedAttentionBackend
from plugins.kv_connectors.multi import MultiConnector
from plugins.kv_connectors.offload import OffloadConnector
from plugins.kv_connectors.shared_storage import SharedStorageConnector

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

TP2 = dict(executor="mp", tensor_parallel_size=2)
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play",
           "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block


def _tokens(outputs):
    assert all(o.error is None for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]


def _run(prompts, **kwargs):
    """Outputs of a fresh engine and its external prefix hits (tokens), the engine shut down."""
    llm = LLM(**ENGINE, **kwargs)
    try:
        tokens = _tokens(llm.generate(prompts, GREEDY))
        assert_no_leak(llm)
        transfer = llm.engine.scheduler.kv_transfer
        return tokens, transfer.external_prefix_cache_hits if transfer is not None else 0
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def plain():
    return _run(PROMPTS)[0]


def test_shared_storage_tp2_producer_then_consumer_is_exact_and_keyed_by_rank(tmp_path, plain, caplog):
    params = {"kv_connector": "shared_storage", "kv_connector_params": {"path": str(tmp_path)}}
    assert _run(PROMPTS, **TP2, **params, kv_role="kv_producer") == (plain, 0)
    rank0 = sorted(p.name.split(".")[0] for p in tmp_path.glob("*.tp0of2.safetensors"))
    rank1 = sorted(p.name.split(".")[0] for p in tmp_path.glob("*.tp1of2.safetensors"))
    assert rank0 and rank0 == rank1, "every block must be stored once per rank"
    assert all(p.name.count(".") == 2 for p in tmp_path.iterdir()), "a TP=2 producer wrote an unsharded file"
    tokens, hits = _run(PROMPTS, **TP2, **params, kv_role="kv_consumer")
    assert tokens == plain and hits > 0
    with caplog.at_level(logging.WARNING, logger="plugins.kv_connectors.shared_storage"):
        assert _run(PROMPTS, **params, kv_role="kv_consumer") == (plain, 0)  # TP=1: recomputes everything
    assert "tensor_parallel_size" in caplog.text and "tp0of2" in caplog.text


def test_offload_passes_the_engine_kit_under_mp_tp2():
    """check_kv_connector_engine at executor=mp tensor_parallel_size=2: one engine, its local prefix cache dropped
    between two runs, loads from its own tiers (shared_storage's producer/consumer pair at TP=2: the test above)."""
    check_kv_connector_engine("offload", MODEL, own_store=True, connector_params={"cpu_bytes": 1 << 20}, **TP2)


def test_offload_tp2_turns_hit_the_cpu_tier_and_stay_exact():
    plain_llm = LLM(**TIGHT)
    expected = conversations(plain_llm)
    llm = LLM(**TIGHT, **TP2, kv_connector="offload", kv_connector_params={"cpu_bytes": 1 << 20})
    try:
        assert conversations(llm) == expected
        assert llm.engine.metrics.summary()["external_prefix_cache_hits"] > 0
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


def test_offload_tp2_disk_loads_park_until_every_rank_has_its_shard_and_stay_exact(tmp_path):
    """A CPU tier of 4.5 blocks over a disk tier (the engine's limits; each rank gets half, for its half of every
    block): disk hits load asynchronously on each rank's reader thread (WAITING_FOR_REMOTE_KVS), and a request goes
    back to the queue only once both ranks reported its load."""
    runner = LLM(**TIGHT).engine.runner
    expected = conversations(LLM(**TIGHT))
    block_bytes = torch.empty(runner.backend.get_kv_cache_shape(1)).nbytes * len(runner.kv_caches)
    llm = LLM(**TIGHT, **TP2, kv_connector="offload", kv_connector_params=dict(
        cpu_bytes=4 * block_bytes + block_bytes // 2, disk_path=str(tmp_path), disk_bytes=40 * block_bytes))
    try:
        transfer, parked = llm.engine.scheduler.kv_transfer, []
        on_admitted = transfer.on_admitted
        transfer.on_admitted = lambda r, b, n, a: parked.append(a) or on_admitted(r, b, n, a)
        assert conversations(llm) == expected
        assert any(parked) and transfer.external_prefix_cache_hits > 0
        assert not transfer.parked and not transfer.loaded and not transfer.held
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("connector", ["shared_storage", "offload_cpu", "offload_disk", "multi"])
def test_passes_the_kit_with_one_worker_side_per_rank(tmp_path, connector):
    backend = TorchPagedAttentionBackend(num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5, block_size=4,
                                         dtype=torch.float32, device=torch.device("cpu"))
    disk = {"cpu_bytes": 0, "disk_path": str(tmp_path / "disk"), "disk_bytes": 1 << 20}
    if connector == "shared_storage":
        check_kv_connector(SharedStorageConnector, backend, tp_size=2, path=str(tmp_path))
    elif connector == "multi":
        check_kv_connector(MultiConnector, backend, tp_size=2, connectors=[
            {"name": "shared_storage", "params": {"path": str(tmp_path)}}])
    else:
        params = {"cpu_bytes": 1 << 20} if connector == "offload_cpu" else disk
        check_kv_connector(OffloadConnector, backend, own_store=True, tp_size=2, **params)


def test_what_stays_refused_names_the_fix(tmp_path):
    from framework.config import EngineConfig

    def problems(**kwargs):
        return kv_transfer_problems(EngineConfig(model="m", kv_connector="shared_storage",
                                                 kv_connector_params={"path": str(tmp_path)}, **kwargs))

    assert problems(**TP2) == [] and problems(tensor_parallel_size=2, executor="ray") == []
    assert any("executor=mp" in p for p in problems(tensor_parallel_size=2, executor="uniproc"))
    multi = MultiConnector.validate(EngineConfig(model="m", kv_connector="multi", **TP2, kv_connector_params={
        "connectors": [{"name": "offload"}, {"name": "zmq"}]}))
    assert any("zmq in the list" in p and "tensor_parallel_size=1" in p for p in multi)
