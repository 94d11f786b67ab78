"""Asynchronous KV loads end to end (stories260K, float32 greedy, multi-turn conversations at a thrashing KV budget):
``offload`` reads disk blocks on its background thread while the request waits in ``WAITING_FOR_REMOTE_KVS`` and
stays token-exact against a plain engine; a disk file lost before its background read is recomputed exactly; a
connector that reports loads only N steps later and frees blocks only N steps after a request finishes (delayed free)
is token-exact too, an abort while parked leaks nothing; no scheduler-side state or block is left."""

from __future__ import annotations

import pytest
import torch
from kv_conversations import ENGINE, TIGHT, assert_no_leak, conversations

from framework import LLM, SamplingParams, hookimpl, registry
from plugins.kv_connectors.offload import OffloadConnector

DELAY = 3  # steps the delayed connector holds each finished transfer


class DelayedOffload(OffloadConnector):
    """``offload`` whose every load is asynchronous and reported ``DELAY`` steps after it is done, and whose every
    finished request keeps its blocks until ``DELAY`` steps after the worker side learns it finished."""

    name = "delayed_offload"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._held: dict[tuple[str, str], int] = {}  # (send | recv, request id) -> steps left before it is reported

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        num_tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return num_tokens, num_tokens > 0

    def _queue_loads(self, request, block_ids, num_external_tokens):
        on_disk, self._on_disk = self._on_disk, set(self._stored)  # every offered block counts as "on disk": async
        try:
            super()._queue_loads(request, block_ids, num_external_tokens)
        finally:
            self._on_disk = on_disk

    def request_finished(self, request, block_ids):
        super().request_finished(request, block_ids)
        return True, None

    def get_finished(self, finished_req_ids):
        _, recving = super().get_finished(finished_req_ids)
        for rid in recving or ():
            self._held[("recv", rid)] = DELAY
        for rid in finished_req_ids:
            self._held[("send", rid)] = DELAY
        due = {key for key, left in self._held.items() if left == 0}
        self._held = {key: left - 1 for key, left in self._held.items() if key not in due}
        return ({rid for kind, rid in due if kind == "send"} or None), ({rid for kind, rid in due if kind == "recv"}
                                                                        or None)


class _Plugin:
    @hookimpl
    def register_kv_connectors(self, register):
        register("delayed_offload", DelayedOffload)


@pytest.fixture(scope="module")
def plain_outputs():
    return conversations(LLM(**ENGINE))


@pytest.fixture(scope="module")
def block_bytes():
    """Bytes of one KV block of stories260K (all layers)."""
    runner = LLM(**TIGHT).engine.runner
    return torch.empty(runner.backend.get_kv_cache_shape(1), dtype=torch.float32).nbytes * len(runner.kv_caches)


def _no_state_left(llm: LLM) -> None:
    transfer = llm.engine.scheduler.kv_transfer
    assert not transfer.parked and not transfer.loaded and not transfer.held
    side = transfer.connector
    assert not side._recving and not side._keys and not side._num_saved
    assert not llm.engine.runner.kv_connector.connector._reading
    assert_no_leak(llm)


def test_disk_loads_run_in_the_background_and_stay_exact(plain_outputs, block_bytes, tmp_path):
    llm = LLM(**TIGHT, kv_connector="offload", kv_connector_params=dict(
        cpu_bytes=4 * block_bytes + block_bytes // 2, disk_path=str(tmp_path), disk_bytes=40 * block_bytes))
    store = llm.engine.runner.kv_connector.connector.store
    reads, parked = [], []
    read_async, on_admitted = store.read_async, llm.engine.scheduler.kv_transfer.on_admitted
    store.read_async = lambda *a: reads.append(a) or read_async(*a)
    llm.engine.scheduler.kv_transfer.on_admitted = lambda r, b, n, a: parked.append(a) or on_admitted(r, b, n, a)
    assert conversations(llm) == plain_outputs
    assert reads and any(parked), "no load went through the background reader while the request was parked"
    assert llm.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
    _no_state_left(llm)


def test_a_disk_file_lost_before_its_background_read_is_recomputed(plain_outputs, block_bytes, tmp_path):
    llm = LLM(**TIGHT, kv_connector="offload", kv_connector_params=dict(
        cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=100 * block_bytes))
    store, lost = llm.engine.runner.kv_connector.connector.store, []
    locate = store.locate

    def locate_losing_the_first(key):
        if not lost and key in store.disk:
            store.flush()
            store._writer.file(key).unlink()
            lost.append(key)
        return locate(key)

    store.locate = locate_losing_the_first
    assert conversations(llm) == plain_outputs
    assert lost
    _no_state_left(llm)


def test_loads_and_frees_reported_steps_later_stay_exact(plain_outputs, block_bytes):
    with registry.registered(_Plugin()):
        llm = LLM(**TIGHT, kv_connector="delayed_offload", kv_connector_params={"cpu_bytes": 64 * block_bytes})
        held = []
        finish = llm.engine.scheduler.kv_transfer.request_finished
        llm.engine.scheduler.kv_transfer.request_finished = lambda r, b: held.append(r.request_id) or finish(r, b)
        assert conversations(llm) == plain_outputs
        assert llm.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0 and held
        _no_state_left(llm)


def test_an_abort_while_parked_frees_once_the_load_is_reported(block_bytes):
    with registry.registered(_Plugin()):
        llm = LLM(**TIGHT, kv_connector="delayed_offload", kv_connector_params={"cpu_bytes": 64 * block_bytes})
        prompt = list(range(5, 30))
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
        llm.engine.scheduler.reset_prefix_cache()
        engine = llm.engine
        engine.add_request("again", prompt, SamplingParams(temperature=0, max_tokens=2))
        engine.step()
        transfer = engine.scheduler.kv_transfer
        assert "again" in transfer.parked and engine.scheduler.requests["again"].status.name == "WAITING_FOR_REMOTE_KVS"
        engine.abort_request("again")
        assert "again" in transfer.held  # the connector cannot cancel: the blocks wait for the load's report
        while engine.has_unfinished_requests():
            engine.step()
        _no_state_left(llm)
