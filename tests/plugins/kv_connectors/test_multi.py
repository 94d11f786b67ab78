"""``kv_connector=multi`` (vLLM's MultiConnector): the first connector with a non-zero match loads (model-free, with
fixed-answer connectors), every connector saves; ``[offload, shared_storage]`` on multi-turn conversations at a
thrashing KV budget is token-exact against a plain engine and loads from offload while it has the tokens, from
shared_storage when a fresh engine's offload tier is empty; the conformance kit; no block leaked."""

from __future__ import annotations

import pytest
import torch
from kv_conversations import BLOCK, ENGINE, TIGHT, assert_no_leak, conversations

from framework import LLM, hookimpl, registry
from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.interfaces import KVConnector, KVConnectorRole
from framework.testing import check_kv_connector
from plugins.attention.torch_paged import TorchPagedAttentionBackend
from plugins.kv_connectors.multi import MultiConnector, register_kv_connectors


class _Fixed(KVConnector):
    """Offers ``tokens`` for every request; records what it was told to load and the events it got back."""

    name = "fixed"

    def __init__(self, role, block_size, kv_role="kv_both", tokens=0, delay_free=False, reasons=None, **params):
        super().__init__(role, block_size, kv_role, **params)
        self.tokens, self.told, self.events, self.reasons = tokens, [], [], reasons
        self.delay_free, self.sent = delay_free, set()  # sent: what get_finished reports as finished sending

    def request_finished(self, request, block_ids):
        return self.delay_free, None

    def get_finished(self, finished_req_ids):
        sent, self.sent = self.sent, set()
        return sent or None, None

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.tokens, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.told.append(num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def update_connector_output(self, connector_output):
        self.events.append(connector_output.kv_cache_events)

    def start_load_kv(self, **kwargs):
        pass  # a scheduler-side double: its worker side moves no K/V

    def wait_for_layer_load(self, layer_idx):
        pass  # no load to wait for

    def save_kv_layer(self, layer_idx, kv_layer, **kwargs):
        pass  # it records scheduler-side events only: nothing to save

    def wait_for_save(self):
        pass  # no save to wait for

    def get_load_error_reasons(self):
        return self.reasons


class _FixedPlugin:
    @hookimpl
    def register_kv_connectors(self, register):
        register("fixed", _Fixed)


def test_registered_and_bad_lists_refused():
    names = []
    register_kv_connectors(register=lambda name, cls: names.append((name, cls)))
    assert names == [("multi", MultiConnector)]
    with pytest.raises(ValueError, match="kv_connector.params.connectors"):
        LLM(**TIGHT, kv_connector="multi")
    with pytest.raises(ValueError, match="cannot be in a multi list"):
        LLM(**TIGHT, kv_connector="multi", kv_connector_params={"connectors": [{"name": "none"}]})


def test_the_first_non_zero_match_loads_and_events_go_home():
    with registry.registered(_FixedPlugin()):
        multi = MultiConnector(KVConnectorRole.SCHEDULER, BLOCK, connectors=[
            {"name": "fixed", "params": {"tokens": 0}}, {"name": "fixed", "params": {"tokens": 4}},
            {"name": "fixed", "params": {"tokens": 8}}])
    request = Request("r", list(range(3, 20)), SamplingParams(max_tokens=1))
    assert multi.get_num_new_matched_tokens(request, 0) == (4, False)  # the second, though the third has more
    multi.update_state_after_alloc(request, list(range(5)), 4)
    assert [c.told for c in multi.connectors] == [[0], [4], [0]]
    multi.update_connector_output(KVConnectorOutput(kv_cache_events=[(2, ("stored", "k")), (0, ("removed", "j"))]))
    assert [c.events for c in multi.connectors] == [[[("removed", "j")]], [None], [[("stored", "k")]]]
    assert multi.request_finished(request, [])[0] is False


def test_load_error_reasons_merge_the_first_connector_s_winning():
    with registry.registered(_FixedPlugin()):
        multi = MultiConnector(KVConnectorRole.WORKER, BLOCK, connectors=[
            {"name": "fixed", "params": {"reasons": {3: "first"}}}, {"name": "fixed"},
            {"name": "fixed", "params": {"reasons": {3: "third", 5: "third"}}}])
    assert multi.get_load_error_reasons() == {3: "first", 5: "third"}
    for connector in multi.connectors:
        connector.reasons = None
    assert multi.get_load_error_reasons() is None


def test_passes_the_kv_connector_contract(tmp_path):
    backend = TorchPagedAttentionBackend(num_heads=8, num_kv_heads=4, head_size=8, scale=8 ** -0.5, block_size=BLOCK,
                                         dtype=torch.float32, device=torch.device("cpu"))
    check_kv_connector(MultiConnector, backend, own_store=True, connectors=[
        {"name": "offload", "params": {"cpu_bytes": 1 << 20}},
        {"name": "shared_storage", "params": {"path": str(tmp_path)}}])


def _multi_llm(path) -> tuple[LLM, list]:
    """An engine of [offload, shared_storage] and the block loads its shared_storage worker side is asked for."""
    llm = LLM(**TIGHT, kv_connector="multi", kv_connector_params={"connectors": [
        {"name": "offload", "params": {"cpu_bytes": 1 << 20}}, {"name": "shared_storage", "params": {"path": str(path)}}]})
    shared = llm.engine.runner.kv_connector.connector.connectors[1]
    loads = []
    start = shared.start_load_kv
    shared.start_load_kv = lambda **kw: loads.extend(shared.connector_metadata().loads) or start(**kw)
    return llm, loads


@pytest.fixture(scope="module")
def plain_outputs():
    return conversations(LLM(**ENGINE))


def test_offload_then_shared_storage_exact(plain_outputs, tmp_path):
    llm, shared_loads = _multi_llm(tmp_path)
    assert conversations(llm) == plain_outputs
    assert llm.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
    assert shared_loads == [], "shared_storage loaded although offload, first in the list, had the tokens"
    assert list(tmp_path.glob("*.safetensors")), "shared_storage saved nothing: multi must save to all"
    assert_no_leak(llm)
    # a fresh engine: its offload tier is empty, so the first turns load from shared_storage, still exact
    fresh, shared_loads = _multi_llm(tmp_path)
    assert conversations(fresh) == plain_outputs
    assert shared_loads
    assert_no_leak(fresh)


def test_a_send_several_connectors_delay_is_finished_once_all_report_it():
    with registry.registered(_FixedPlugin()):
        params = [{"name": "fixed", "params": {"delay_free": True}}, {"name": "fixed", "params": {"delay_free": True}},
                  {"name": "fixed"}]
        sched, worker = (MultiConnector(role, BLOCK, connectors=params)
                         for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER))
    request = Request("r", list(range(3, 20)), SamplingParams(max_tokens=1))
    assert sched.request_finished(request, [0, 1]) == (True, None)
    meta = sched.build_connector_meta(None)
    assert meta.extra_async_saves == {"r": 1} and sched.build_connector_meta(None).extra_async_saves == {}
    worker.bind_connector_metadata(meta)
    worker.connectors[0].sent = {"r"}
    assert worker.get_finished({"r"}) == (None, None)  # the second connector still sends it
    worker.connectors[1].sent = {"r"}
    assert worker.get_finished(set()) == ({"r"}, None)


def test_every_connectors_transfer_stats_reach_the_metrics():
    with registry.registered(_FixedPlugin()):
        multi = MultiConnector(KVConnectorRole.WORKER, BLOCK, connectors=[
            {"name": "fixed"}, {"name": "fixed"}, {"name": "fixed"}])
    assert multi.get_kv_connector_stats() is None  # nobody moved anything
    multi.connectors[0].get_kv_connector_stats = lambda: [(4096, 0.5)]
    multi.connectors[2].get_kv_connector_stats = lambda: [(1024, 0.25), (2048, 0.125)]
    assert multi.get_kv_connector_stats() == [(4096, 0.5), (1024, 0.25), (2048, 0.125)]
