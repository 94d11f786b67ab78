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
