"""``KVOutputAggregator`` (framework/executor/kv_output_aggregator.py): a transfer is finished once every rank says
so, across steps; load errors are the union; store events pass once every rank reported them (vLLM's rules)."""

from __future__ import annotations

import pytest

from framework.core.outputs import KVConnectorOutput, ModelRunnerOutput
from framework.executor.kv_output_aggregator import KVOutputAggregator


def test_a_transfer_finishes_when_every_rank_reported_it_across_steps():
    agg = KVOutputAggregator(2)
    first = agg.aggregate([KVConnectorOutput(finished_sending={"a"}, finished_recving={"r"}),
                           KVConnectorOutput(finished_sending=None, finished_recving={"r"})])
    assert first.finished_sending is None and first.finished_recving == {"r"}
    second = agg.aggregate([KVConnectorOutput(), KVConnectorOutput(finished_sending={"a"})])
    assert second.finished_sending == {"a"} and second.finished_recving is None
    assert agg.aggregate([KVConnectorOutput(), KVConnectorOutput()]).finished_sending is None  # reported once


def test_load_errors_are_the_union_and_stats_concatenate():
    agg = KVOutputAggregator(2)
    out = agg.aggregate([KVConnectorOutput(invalid_block_ids={3}, kv_connector_stats=[(10, 0.1)]),
                         KVConnectorOutput(invalid_block_ids={3, 7}, kv_connector_stats=[(10, 0.2)])])
    assert out.invalid_block_ids == {3, 7} and out.kv_connector_stats == [(10, 0.1), (10, 0.2)]
    assert out.load_error_reasons is None


def test_load_error_reasons_are_the_union_the_lowest_rank_winning():
    out = KVOutputAggregator(2).aggregate([KVConnectorOutput(invalid_block_ids={3}, load_error_reasons={3: "r0"}),
                                           KVConnectorOutput(invalid_block_ids={3, 7},
                                                             load_error_reasons={3: "r1", 7: "r1"})])
    assert out.load_error_reasons == {3: "r0", 7: "r1"}


def test_events_pass_once_every_rank_reported_them_counted_as_a_multiset():
    agg = KVOutputAggregator(2)
    out = agg.aggregate([KVConnectorOutput(kv_cache_events=[("stored", "k"), ("removed", "k"), ("stored", "k")]),
                         KVConnectorOutput(kv_cache_events=[("stored", "k")])])
    assert out.kv_cache_events == [("stored", "k")]
    out = agg.aggregate([KVConnectorOutput(), KVConnectorOutput(kv_cache_events=[["removed", "k"], ("stored", "k")])])
    assert out.kv_cache_events == [["removed", "k"], ("stored", "k")]
    assert agg.aggregate([KVConnectorOutput(), KVConnectorOutput()]).kv_cache_events is None


def test_one_rank_passes_through_and_bad_input_is_refused():
    events = [("stored", "k"), ("stored", "k")]
    assert KVOutputAggregator(1).aggregate([KVConnectorOutput(kv_cache_events=events)]).kv_cache_events == events
    assert KVOutputAggregator(2).aggregate([None, None]) is None
    with pytest.raises(ValueError, match="one per rank"):
        KVOutputAggregator(2).aggregate([KVConnectorOutput()])
    with pytest.raises(ValueError, match="every rank must build"):
        KVOutputAggregator(2).aggregate([KVConnectorOutput(), None])
    with pytest.raises(ValueError, match="world_size >= 1"):
        KVOutputAggregator(0)


def test_merge_into_replaces_the_driver_reply_s_report():
    driver = ModelRunnerOutput(sampled_token_ids={"r": [5]}, kv_connector_output=KVConnectorOutput(invalid_block_ids={1}))
    other = ModelRunnerOutput(sampled_token_ids={}, kv_connector_output=KVConnectorOutput(invalid_block_ids={2}))
    out = KVOutputAggregator(2).merge_into([other, driver], driver_rank=1)
    assert out is driver and out.sampled_token_ids == {"r": [5]} and out.kv_connector_output.invalid_block_ids == {1, 2}
