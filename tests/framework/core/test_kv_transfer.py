"""The scheduler with a KV connector (``framework/core/kv_transfer.py``), model-free: a scripted connector offers
tokens; admission counts them as computed and allocates their blocks; the last token is always computed; a load
failure drops the bad blocks from the prefix cache and recomputes (or fails the request alone); the external
prefix-cache counters; no block leaks (asynchronous loads and delayed frees: test_kv_transfer_async.py)."""

from __future__ import annotations

from typing import Any

import pytest

from framework.core.kv_transfer import KVTransfer
from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput, ModelRunnerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.interfaces import KVConnector, KVConnectorRole
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy

BS = 4


class ScriptedConnector(KVConnector):
    """Offers ``offer`` tokens to every request; records what the scheduler told it."""

    name = "scripted"

    def __init__(self, offer: int = 0, load_async: bool = False, delay_free: bool = False, **kwargs: Any) -> None:
        super().__init__(role=KVConnectorRole.SCHEDULER, block_size=BS, kv_role="kv_consumer", **kwargs)
        self.offer, self.load_async, self.delay_free = offer, load_async, delay_free
        self.allocs: list[tuple[str, int, int]] = []  # (request id, its num_computed_tokens then, external tokens)
        self.outputs: list[KVConnectorOutput] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (self.offer if self.is_consumer else 0), self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, request.num_computed_tokens, num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output):
        self.outputs.append(connector_output)

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return self.delay_free, {"done": request.request_id}

    def start_load_kv(self, **kwargs):
        raise AssertionError("worker side: not used by the scheduler")

    def wait_for_layer_load(self, layer_idx):
        raise AssertionError("worker side: not used by the scheduler")

    def save_kv_layer(self, layer_idx, kv_layer, **kwargs):
        raise AssertionError("worker side: not used by the scheduler")

    def wait_for_save(self):
        raise AssertionError("worker side: not used by the scheduler")


def make(connector: ScriptedConnector, policy: str = "recompute") -> Scheduler:
    kv = PagedKVAllocator(32, BS, enable_prefix_caching=True)
    return Scheduler(FCFSPolicy(), kv, StopChecker(tokenizer=None), max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=128, kv_transfer=KVTransfer(connector, policy))


def request(rid: str, n: int, max_tokens: int = 2) -> Request:
    return Request(rid, list(range(100 * len(rid), 100 * len(rid) + n)), SamplingParams(max_tokens=max_tokens),
                   eos_token_ids=frozenset())


def run_step(sched: Scheduler, invalid: set[int] = frozenset()):
    out = sched.schedule()
    runner = ModelRunnerOutput(
        sampled_token_ids={r.request_id: [7] for r in out.scheduled_requests
                           if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens},
        kv_connector_output=KVConnectorOutput(invalid_block_ids=set(invalid)))
    return out, sched.update_from_output(out, runner)


def test_external_tokens_count_as_computed_and_get_blocks():
    connector = ScriptedConnector(offer=8)
    sched = make(connector)
    sched.add_request(request("a", 14))
    out, _ = run_step(sched)
    assert connector.allocs == [("a", 0, 8)]
    assert out.num_scheduled_tokens["a"] == 14 - 8  # only the tokens after the loaded ones are computed
    assert len(out.block_ids["a"][0]) == 4  # the loaded blocks are allocated too
    assert isinstance(out.kv_connector_metadata, KVConnectorMetadata)
    transfer = sched.kv_transfer
    assert (transfer.external_prefix_cache_queries, transfer.external_prefix_cache_hits) == (14, 8)
    assert len(connector.outputs) == 1  # update_connector_output got the step's report


def test_the_last_token_is_always_computed():
    connector = ScriptedConnector(offer=12)  # the whole prompt
    sched = make(connector)
    sched.add_request(request("a", 12))
    out, _ = run_step(sched)
    assert connector.allocs == [("a", 0, 11)] and out.num_scheduled_tokens["a"] == 1


def test_load_failure_recompute_evicts_and_recomputes_from_the_bad_block():
    connector = ScriptedConnector(offer=8)
    sched = make(connector)
    sched.add_request(request("a", 14, max_tokens=1))
    out = sched.schedule()
    table = list(out.block_ids["a"][0])
    bad = table[1]
    runner = ModelRunnerOutput(sampled_token_ids={"a": [7]},
                               kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}))
    updated, finished = sched.update_from_output(out, runner)
    a = sched.requests["a"]
    assert not updated and not finished and a.num_output_tokens == 0  # the step's token is dropped
    assert a.num_computed_tokens == BS  # recompute from the bad block
    assert sched.kv._block_hash[bad] is None and sched.kv._block_hash[table[0]] is not None  # evict_blocks
    sched.kv.check_invariants()
    out, (updated, finished) = run_step(sched)
    assert out.num_scheduled_tokens["a"] == 14 - BS and [r.request_id for r in finished] == ["a"]
    assert connector.finished == ["a"] and finished[0].kv_transfer_params == {"done": "a"}  # request_finished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_load_failure_fail_records_a_fault_for_that_request_only():
    connector = ScriptedConnector(offer=8)
    sched = make(connector, "fail")
    sched.add_request(request("a", 14))
    sched.add_request(request("bb", 3))
    out = sched.schedule()
    bad = out.block_ids["a"][0][0]
    runner = ModelRunnerOutput(sampled_token_ids={"a": [7], "bb": [7]},
                               kv_connector_output=KVConnectorOutput(invalid_block_ids={bad}))
    updated, _ = sched.update_from_output(out, runner)
    assert [r.request_id for r in updated] == ["bb"]
    failures = sched.faults.take()
    assert list(failures) == ["a"] and "failed to load" in failures["a"].error
    aborted = sched.abort_requests(list(failures), failures)  # what the engine does after the update
    assert aborted[0].error == failures["a"].error
    assert sched.kv._block_hash[bad] is None


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="recompute or fail"):
        KVTransfer(ScriptedConnector(), "retry")
