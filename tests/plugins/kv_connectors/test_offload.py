"""``kv_connector=offload``: at a KV budget smaller than a multi-turn working set (stories260K, float32 greedy), later
turns load their earlier turns' blocks from the CPU tier or the disk tier and stay token-exact against a plain
engine; both tiers stay within their byte limits (exact nbytes); the LRU order, spills and promotions model-free;
the conformance kit; no block leaked."""

from __future__ import annotations

import logging

import pytest
import torch
from kv_conversations import BLOCK, ENGINE, TIGHT, assert_no_leak, conversations

from framework import LLM, registry
from framework.interfaces.kv_connector import prefix_block_hashes
from framework.testing import check_kv_connector
from plugins.attention.torch_paged import TorchPagedAttentionBackend
from plugins.kv_connectors._tiers import TieredBlockStore
from plugins.kv_connectors.offload import OffloadConnector, register_kv_connectors

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # the offload tiers, not the attention kernel


def offload_llm(**params) -> LLM:
    return LLM(**TIGHT, kv_connector="offload", kv_connector_params=params)


def store_of(llm: LLM) -> TieredBlockStore:
    return llm.engine.runner.kv_connector.connector.store


def assert_within_limits(store: TieredBlockStore) -> None:
    """Both tiers' byte counts are their blocks' exact nbytes and within the limits; disk files hold those bytes."""
    store.flush()
    assert store.cpu_used == sum(t.nbytes for block in store.cpu.values() for t in block) <= store.cpu_bytes
    assert store.disk_used == sum(store.disk.values()) <= store.disk_bytes
    if store.disk_folder is not None:
        files = {p.stem: p.stat().st_size for p in store.disk_folder.glob("*.kv")}
        assert files == dict(store.disk)


@pytest.fixture(scope="module")
def plain_outputs():
    return conversations(LLM(**ENGINE))


@pytest.fixture(scope="module")
def block_bytes():
    """Bytes of one KV block of stories260K (all layers), as the engine reports them."""
    llm = LLM(**TIGHT)
    runner = llm.engine.runner
    one = torch.empty(runner.backend.get_kv_cache_shape(1), dtype=torch.float32).nbytes
    return one * len(runner.kv_caches)


def test_registered_and_bad_params_refused(tmp_path):
    names = []
    register_kv_connectors(register=lambda name, cls: names.append((name, cls)))
    assert names == [("offload", OffloadConnector)]
    assert registry.get_class("kv_connector", "offload") is OffloadConnector
    with pytest.raises(ValueError, match="disk_bytes needs kv_connector.params.disk_path"):
        LLM(**TIGHT, kv_connector="offload", kv_connector_params={"disk_bytes": 1 << 20})
    with pytest.raises(ValueError, match="cpu_bytes must be a number of bytes"):
        LLM(**TIGHT, kv_connector="offload", kv_connector_params={"cpu_bytes": -1})


@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_passes_the_kv_connector_contract(tmp_path, tiers):
    backend = TorchPagedAttentionBackend(num_heads=8, num_kv_heads=4, head_size=8, scale=8 ** -0.5, block_size=BLOCK,
                                         dtype=torch.float32, device=torch.device("cpu"),
                                         compile=False)  # the contract, not the kernel
    params = {"cpu_bytes": 1 << 20} if tiers == "cpu" else {"cpu_bytes": 0, "disk_path": str(tmp_path),
                                                            "disk_bytes": 1 << 20}
    check_kv_connector(OffloadConnector, backend, own_store=True, **params)


def test_plain_tight_engine_misses_its_earlier_turns(plain_outputs):
    """The premise: at this budget the local prefix cache alone loses the earlier turns (and stays exact)."""
    llm = LLM(**TIGHT)
    assert conversations(llm) == plain_outputs
    stats = llm.engine.scheduler.kv.stats()
    assert stats.prefix_hits_tokens < stats.prefix_queries_tokens // 4


def test_cpu_tier_turns_hit_and_stay_exact(plain_outputs, block_bytes):
    llm = offload_llm(cpu_bytes=64 * block_bytes)
    assert conversations(llm) == plain_outputs
    summary = llm.engine.metrics.summary()
    assert summary["external_prefix_cache_hits"] > 0
    assert summary["external_prefix_cache_hits"] == llm.engine.scheduler.kv_transfer.external_prefix_cache_hits
    store = store_of(llm)
    assert store.cpu and not store.disk
    assert_within_limits(store)
    assert_no_leak(llm)
    scheduler_side = llm.engine.scheduler.kv_transfer.connector
    assert not scheduler_side._keys and not scheduler_side._num_saved, "finished requests left scheduler-side state"
    assert scheduler_side._stored == set(store.cpu), "the scheduler side's view differs from the tiers"


def test_disk_spill_and_reload_are_exact(plain_outputs, block_bytes, tmp_path):
    """A CPU tier of 4 blocks spills to a 40-block disk tier; the turns load from disk (and promote) exactly
    (synchronous disk reads, ``async_load=False``; the asynchronous path: test_offload_async.py)."""
    llm = offload_llm(cpu_bytes=4 * block_bytes + block_bytes // 2, disk_path=str(tmp_path), disk_bytes=40 * block_bytes,
                      async_load=False)
    store = store_of(llm)
    reads = []
    get = store.get
    store.get = lambda key: reads.append(key in store.disk) or get(key)
    assert conversations(llm) == plain_outputs
    assert any(reads), "no load came from the disk tier"
    assert llm.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
    assert len(store.cpu) == 4 and len(store.disk) > 4
    assert_within_limits(store)
    assert_no_leak(llm)
    folder = store.disk_folder
    assert folder.parent == tmp_path and folder.is_dir()
    store.close()
    assert not folder.exists(), "the disk tier's folder outlived its store"


def test_batched_turns_preempt_reload_and_stay_exact(block_bytes):
    """Each turn of the three conversations in one batch at this budget: requests preempt (recompute), re-admitted
    ones load from the CPU tier, outputs equal a plain engine's batched run."""
    llm = offload_llm(cpu_bytes=64 * block_bytes)
    assert conversations(llm, batched=True) == conversations(LLM(**ENGINE), batched=True)
    assert llm.engine.metrics.num_preemptions > 0
    assert llm.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
    assert_within_limits(store_of(llm))
    assert_no_leak(llm)


def test_a_lost_disk_file_is_recomputed_exactly(plain_outputs, block_bytes, tmp_path):
    """The file of a block the scheduler side offered disappears before the load: the load fails, the request
    recomputes from that block (kv_transfer.load_failure_policy=recompute) and skips that step's saves; exact."""
    llm = offload_llm(cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=100 * block_bytes, async_load=False)
    store, lost = store_of(llm), []
    get = store.get

    def get_losing_the_first(key):
        if not lost and key in store.disk:
            store.flush()
            store._writer.file(key).unlink()
            lost.append(key)
        return get(key)

    store.get = get_losing_the_first
    assert conversations(llm) == plain_outputs
    assert lost and llm.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
    assert_no_leak(llm)


def test_prefix_keys_extend_from_known_keys():
    tokens = list(range(3, 30))
    assert prefix_block_hashes(tokens, BLOCK, "a", known=prefix_block_hashes(tokens[:9], BLOCK, "a")) == (
        prefix_block_hashes(tokens, BLOCK, "a"))


def test_a_block_larger_than_the_tiers_is_not_stored(plain_outputs, block_bytes, caplog):
    with caplog.at_level(logging.WARNING, logger="plugins.kv_connectors._tiers"):
        llm = offload_llm(cpu_bytes=block_bytes - 1)
        assert conversations(llm) == plain_outputs
    assert llm.engine.scheduler.kv_transfer.external_prefix_cache_hits == 0
    assert not store_of(llm).cpu
    assert sum("larger than both tiers" in r.message for r in caplog.records) == 1
    assert_no_leak(llm)


def _block(value: float, nbytes: int = 64) -> list[torch.Tensor]:
    return [torch.full((nbytes // 8,), float(value)), torch.full((nbytes // 8,), -float(value))]


def test_lru_spill_promotion_and_byte_accounting(tmp_path):
    """Model-free: blocks of 64 bytes, CPU tier of 2, disk tier of 2; least recently used first out of each."""
    layout = [((8,), torch.float32), ((8,), torch.float32)]
    store = TieredBlockStore(cpu_bytes=128, disk_path=str(tmp_path), disk_bytes=150, layout=layout)
    for i, key in enumerate("abc"):
        store.put(key, _block(i))
    assert list(store.cpu) == ["b", "c"] and list(store.disk) == ["a"]  # a spilled
    assert store.get("b")[1] is False  # b is now the CPU tier's most recent
    store.put("d", _block(3))  # evicts c, the CPU tier's least recently used
    assert list(store.cpu) == ["b", "d"] and list(store.disk) == ["a", "c"]
    store.put("e", _block(4))  # b spills; the disk tier drops a
    assert list(store.cpu) == ["d", "e"] and list(store.disk) == ["c", "b"]
    events = store.take_events()
    assert [e for e in events if e[0] != "disk"] == [("stored", k) for k in "abcd"] + [("removed", "a"), ("stored", "e")]
    assert [e for e in events if e[0] == "disk"] == [("disk", "a"), ("disk", "c"), ("disk", "b")]  # tier moves
    store.flush()
    block, from_disk = store.get("c")  # read back from its file
    assert from_disk and all(torch.equal(x, y) for x, y in zip(block, _block(2)))
    store.put("c", block)  # promoted: d spills, c leaves the disk tier
    assert list(store.cpu) == ["e", "c"] and list(store.disk) == ["b", "d"]
    assert store.take_events() == [("cpu", "c"), ("disk", "d")]  # nothing gained or lost, only moved
    assert (store.cpu_used, store.disk_used) == (128, 128)
    assert_within_limits(store)
    store.put("x", _block(9, nbytes=256))  # larger than both tiers: not stored
    assert "x" not in store and store.take_events() == []
    store.close()
