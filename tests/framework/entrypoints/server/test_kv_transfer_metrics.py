"""``/metrics`` carries a KV connector's external prefix-cache counters (vLLM's names, ``servelab:`` prefix): they
grow by what each replica publication added, from the engine's metrics (``engine/core.py``'s ``replica_stats``)."""

from __future__ import annotations

from framework.engine.core_messages import ReplicaStats
from framework.entrypoints.server.metrics import ServerMetrics


def _value(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_external_prefix_cache_counters_grow_by_each_publication():
    metrics = ServerMetrics("m")
    metrics.observe_stats(ReplicaStats(replica_id=0, external_prefix_queries_tokens=40, external_prefix_hits_tokens=24))
    metrics.observe_stats(ReplicaStats(replica_id=0, external_prefix_queries_tokens=50, external_prefix_hits_tokens=32))
    text = metrics.render().decode()
    assert _value(text, "servelab:external_prefix_cache_queries_total") == 50
    assert _value(text, "servelab:external_prefix_cache_hits_total") == 32


def _histogram(text: str, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram series."""
    return _value(text, name + "_count"), _value(text, name + "_sum")


def test_kv_transfer_histograms_observe_each_publications_new_transfers():
    metrics = ServerMetrics("m")
    metrics.observe_stats(ReplicaStats(replica_id=0, num_kv_transfers=2,
                                       recent_kv_transfers=[(1 << 20, 0.5), (1 << 22, 0.25)]))
    # the next publication repeats the last record and adds one: only the new one is observed
    metrics.observe_stats(ReplicaStats(replica_id=0, num_kv_transfers=3,
                                       recent_kv_transfers=[(1 << 20, 0.5), (1 << 22, 0.25), (1 << 16, 0.125)]))
    metrics.observe_stats(ReplicaStats(replica_id=1, num_kv_transfers=1, recent_kv_transfers=[(1 << 18, 1.0)]))
    text = metrics.render().decode()
    assert _histogram(text, "servelab:kv_transfer_bytes") == (4, (1 << 20) + (1 << 22) + (1 << 16) + (1 << 18))
    assert _histogram(text, "servelab:kv_transfer_seconds") == (4, 1.875)


def test_replica_stats_carry_the_collectors_last_transfers():
    from collections import deque
    from types import SimpleNamespace

    from framework.engine.core import _kv_transfers
    from framework.engine.core_messages import RECENT_KV_TRANSFERS

    none = SimpleNamespace(kv_transfer_totals={"num_kv_transfers": 0}, kv_transfers=deque())
    assert _kv_transfers(none) == {}
    records = deque([(float(i), i / 10) for i in range(100)])
    many = SimpleNamespace(kv_transfer_totals={"num_kv_transfers": 100}, kv_transfers=records)
    fields = _kv_transfers(many)
    assert fields["num_kv_transfers"] == 100
    assert fields["recent_kv_transfers"] == list(records)[-RECENT_KV_TRANSFERS:]
