"""Asynchronous KV loads (``WAITING_FOR_REMOTE_KVS``) and delayed frees in the scheduler, model-free
(``framework/core/kv_transfer.py``): a parked request holds its blocks, is in no step, and its blocks serve no prefix
hit until its load is reported done; then it runs with the loaded tokens computed; an abort while parked frees its
blocks at once (the connector cancels) or once the load is done (it cannot); load failures follow the policy; a
delayed free keeps the blocks until ``finished_sending`` while the output is returned at once; no block leaks."""

from __future__ import annotations

from framework.core.outputs import KVConnectorOutput, ModelRunnerOutput
from framework.core.request import RequestStatus
from tests.framework.core.test_kv_transfer import BS, ScriptedConnector, make, request


def step(sched, recving=(), sending=(), invalid=()):
    """One step whose worker side reports the given finished transfers and bad blocks."""
    out = sched.schedule()
    runner = ModelRunnerOutput(
        sampled_token_ids={r.request_id: [7] for r in out.scheduled_requests
                           if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens},
        kv_connector_output=KVConnectorOutput(finished_recving=set(recving) or None,
                                              finished_sending=set(sending) or None, invalid_block_ids=set(invalid)))
    return out, sched.update_from_output(out, runner)


def test_a_parked_request_holds_its_blocks_and_is_in_no_step_until_its_load_is_done():
    connector = ScriptedConnector(offer=8, load_async=True)
    sched = make(connector)
    sched.add_request(request("a", 14, max_tokens=1))
    out, _ = step(sched)
    a = sched.requests["a"]
    assert a.status is RequestStatus.WAITING_FOR_REMOTE_KVS and not out.scheduled_requests
    assert out.total_num_scheduled_tokens == 0 and sched.num_waiting == 1 and sched.kv_transfers_in_flight
    table = list(sched.kv.get_block_ids("a"))
    assert len(table) == 2 and all(sched.kv._block_hash[b] is None for b in table)  # allocated, not published
    assert connector.allocs == [("a", 0, 8)]
    out, _ = step(sched)  # still loading
    assert not out.scheduled_requests and a.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    out, _ = step(sched, recving={"a"})
    assert not out.scheduled_requests and a.num_computed_tokens == 8  # done: published, back in the queue
    assert all(sched.kv._block_hash[b] is not None for b in table) and not sched.kv_transfers_in_flight
    out, (_, finished) = step(sched)
    assert out.num_scheduled_tokens == {"a": 14 - 8} and out.block_ids["a"][0][:2] == table
    assert [r.request_id for r in finished] == ["a"] and sched.kv.num_free_blocks == sched.kv.num_blocks
    transfer = sched.kv_transfer
    assert (transfer.external_prefix_cache_queries, transfer.external_prefix_cache_hits) == (14, 8)
    assert connector.allocs == [("a", 0, 8), ("a", 8, 0)]  # re-admission: nothing more to load
    sched.kv.check_invariants()


def test_no_prefix_hit_on_blocks_not_loaded_yet():
    connector = ScriptedConnector(offer=8, load_async=True)
    sched = make(connector)
    sched.add_request(request("a", 14, max_tokens=1))
    step(sched)
    connector.offer = 0  # the twin asks the connector for nothing: only the local prefix cache could serve it
    twin = request("a", 14, max_tokens=1)
    twin.request_id = "twin"
    sched.add_request(twin)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"twin": 14} and twin.num_cached_tokens == 0  # no hit on a's blocks
    assert not set(out.block_ids["twin"][0]) & set(sched.kv.get_block_ids("a"))
    sched.kv.check_invariants()


def test_an_abort_while_parked_frees_at_once_when_the_connector_cancels():
    connector = ScriptedConnector(offer=8, load_async=True)
    sched = make(connector)
    sched.add_request(request("a", 14))
    step(sched)
    sched.abort_requests(["a"])
    assert connector.finished == ["a"] and sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.has_unfinished_requests() and not sched.kv_transfers_in_flight
    step(sched, recving={"a"})  # a late report of a cancelled load is ignored
    sched.kv.check_invariants()


def test_an_abort_while_parked_keeps_the_blocks_until_the_load_is_done():
    connector = ScriptedConnector(offer=8, load_async=True, delay_free=True)
    sched = make(connector)
    sched.add_request(request("a", 14))
    step(sched)
    sched.abort_requests(["a"])
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 2 and sched.has_unfinished_requests()
    step(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 2
    step(sched, recving={"a"})
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.has_unfinished_requests()
    sched.kv.check_invariants()


def test_a_failed_asynchronous_load_recomputes_from_the_bad_block():
    sched = make(ScriptedConnector(offer=12, load_async=True))
    sched.add_request(request("a", 14, max_tokens=1))
    step(sched)
    table = list(sched.kv.get_block_ids("a"))
    step(sched, invalid={table[1]})  # reported before the load is done: remembered
    step(sched, recving={"a"})
    a = sched.requests["a"]
    assert a.num_computed_tokens == BS  # the first good block only
    assert sched.kv._block_hash[table[0]] is not None and sched.kv._block_hash[table[1]] is None
    out, (_, finished) = step(sched)
    assert out.num_scheduled_tokens == {"a": 14 - BS} and [r.request_id for r in finished] == ["a"]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_a_failed_asynchronous_load_fails_the_request_under_fail():
    sched = make(ScriptedConnector(offer=8, load_async=True), "fail")
    sched.add_request(request("a", 14))
    step(sched)
    bad = sched.kv.get_block_ids("a")[0]
    step(sched, recving={"a"}, invalid={bad})
    failures = sched.faults.take()
    assert list(failures) == ["a"] and "failed to load" in failures["a"].error
    sched.abort_requests(list(failures), failures)  # what the engine does after the update
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.has_unfinished_requests()


def test_a_delayed_free_keeps_the_blocks_until_finished_sending():
    connector = ScriptedConnector(delay_free=True)
    sched = make(connector)
    sched.add_request(request("a", 6, max_tokens=1))
    _, (_, finished) = step(sched)
    assert [r.request_id for r in finished] == ["a"] and finished[0].kv_transfer_params == {"done": "a"}
    assert sched.kv.num_free_blocks == sched.kv.num_blocks - 2  # output returned, blocks still read
    assert sched.has_unfinished_requests() and sched.kv_transfers_in_flight and "a" not in sched.requests
    out, _ = step(sched)
    assert not out.scheduled_requests and sched.kv.num_free_blocks == sched.kv.num_blocks - 2
    step(sched, sending={"a"})
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.has_unfinished_requests()
    sched.kv.check_invariants()


def test_paged_cache_blocks_publishes_what_evict_blocks_hid():
    sched = make(ScriptedConnector())
    kv = sched.kv
    a = request("a", 10)
    kv.allocate_slots(a, 10)
    table = list(kv.get_block_ids("a"))
    kv.evict_blocks(table)
    assert kv.get_computed_blocks(request("a", 10)) == ([], 0)
    kv.cache_blocks(a, 9)  # two full blocks; the partial third is never published
    assert kv.get_computed_blocks(request("a", 10)) == (table[:2], 8)
    assert kv._block_hash[table[2]] is None
    kv.check_invariants()
