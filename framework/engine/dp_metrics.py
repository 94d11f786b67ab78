"""Metrics of a data-parallel front: request-level numbers over every replica, step-level ones combined from
the replicas' collectors, and a per-replica breakdown (the routers' study needs each replica's load)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from framework.engine.replica_set import ReplicaSet
from framework.interfaces.engine import ReplicaEngine
from framework.metrics.collector import MetricsCollector

#: per-replica summary keys copied into ``replicas`` (the rest of a replica's summary stays with it)
REPLICA_KEYS = ("num_requests", "num_failed", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                "num_steps", "mean_kv_cache_usage", "peak_kv_cache_usage", "mean_num_running_reqs",
                "peak_num_running_reqs", "num_preemptions", "step_s")


class DataParallelMetrics:
    """The ``engine.metrics`` of a :class:`~framework.engine.data_parallel.DataParallelEngine`.

    Args:
        front: collector of every finished request across replicas (TTFT, TPOT, ITL, e2e, throughput).
        replicas: the replicas' engines, whose collectors hold the step-level numbers.
        replica_set: which replicas serve and how many requests each was routed.
        router: the router's name (``config.router``).
    """

    def __init__(self, front: MetricsCollector, replicas: Sequence[ReplicaEngine], replica_set: ReplicaSet,
                 router: str) -> None:
        self.front = front
        self._replicas = list(replicas)
        self._set = replica_set
        self._router = router

    @property
    def run_labels(self) -> dict[str, Any]:
        """The replicas' executor labels (``simulated``, ``sim_profile``)."""
        return self.front.run_labels

    @property
    def timeline(self) -> list[dict[str, float]]:
        """Every replica's per-step rows, each with its ``replica`` id, ordered by time."""
        rows = [dict(row, replica=i) for i, r in enumerate(self._replicas) for row in r.metrics.timeline]
        return sorted(rows, key=lambda row: row["time_s"])

    def replica_summaries(self, duration_s: float | None = None) -> list[dict[str, Any]]:
        """Per replica: ``replica_id``, ``alive``, ``num_routed`` (requests the router sent it),
        ``prefix_cache_hit_rate`` (hit / queried prompt tokens over its admissions) and :data:`REPLICA_KEYS`."""
        out = []
        for i, replica in enumerate(self._replicas):
            summary = replica.metrics.summary(duration_s)
            kv = replica.kv_allocator.stats()
            out.append({"replica_id": i, "alive": self._set.alive[i], "num_routed": self._set.num_routed[i],
                        "prefix_cache_hit_rate": kv.hit_rate, "prefix_queries_tokens": kv.prefix_queries_tokens,
                        "prefix_hits_tokens": kv.prefix_hits_tokens, **{k: summary[k] for k in REPLICA_KEYS}})
        return out

    def summary(self, duration_s: float | None = None) -> dict[str, Any]:
        """``MetricsCollector.summary``'s keys over the whole front, plus ``data_parallel_size``, ``router``,
        ``replicas`` (:meth:`replica_summaries`) and ``load_imbalance`` (max / mean requests routed per live
        replica; 1.0 is perfectly even).

        Request latencies and throughputs come from every finished request; ``prefix_cache_hit_rate`` is hit /
        queried tokens summed over replicas; step counts and preemptions are sums; KV usage and concurrency
        means are the replicas' means averaged (peaks: the highest replica's).
        """
        out = self.front.summary(duration_s)
        first = self._replicas[0].metrics.summary(duration_s)
        for key in ("kv_cache_dtype", "kv_cache_num_blocks", "kv_cache_bytes_per_block", "compile_mode",
                    "compile_reason"):
            if key in first:
                out[key] = first[key]
        replicas = self.replica_summaries(duration_s)
        queried = sum(r["prefix_queries_tokens"] for r in replicas)
        out.update(
            prefix_cache_hit_rate=sum(r["prefix_hits_tokens"] for r in replicas) / queried if queried else 0.0,
            num_steps=sum(r["num_steps"] for r in replicas), num_preemptions=sum(r["num_preemptions"] for r in replicas),
            mean_kv_cache_usage=sum(r["mean_kv_cache_usage"] for r in replicas) / len(replicas),
            peak_kv_cache_usage=max(r["peak_kv_cache_usage"] for r in replicas),
            mean_num_running_reqs=sum(r["mean_num_running_reqs"] for r in replicas),
            peak_num_running_reqs=max(r["peak_num_running_reqs"] for r in replicas),
            step_s=sum(r["step_s"] for r in replicas),
            data_parallel_size=len(replicas), router=self._router, replicas=replicas)
        routed = [r["num_routed"] for r in replicas if r["alive"]]
        out["load_imbalance"] = max(routed) / (sum(routed) / len(routed)) if routed and sum(routed) else 1.0
        return out
