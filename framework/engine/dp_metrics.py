"""Metrics of a data-parallel front: request-level numbers over every replica, step-level ones combined from
the replicas' collectors, and a per-replica breakdown (the routers' study needs each replica's load). A P/D front
(``disagg.prefill_replicas``) combines both pools' replicas the same way (:meth:`DataParallelMetrics.over_pools`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from framework.engine.replica_set import ReplicaSet
from framework.interfaces.engine import ReplicaEngine
from framework.metrics.collector import MetricsCollector, kv_transfer_summary

#: per-replica summary keys copied into ``replicas`` (the rest of a replica's summary stays with it)
REPLICA_KEYS = ("num_requests", "num_failed", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                "num_steps", "mean_kv_cache_usage", "peak_kv_cache_usage", "mean_num_running_reqs",
                "peak_num_running_reqs", "num_preemptions", "step_s", "external_prefix_cache_queries",
                "external_prefix_cache_hits")


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
        # (replicas, their set, the pool's role or None: each replica's role from its set)
        self._pools: list[tuple[list[ReplicaEngine], ReplicaSet, str | None]] = [(list(replicas), replica_set, None)]
        self._router = router

    @classmethod
    def over_pools(cls, front: MetricsCollector, pools: Sequence[tuple[Sequence[ReplicaEngine], ReplicaSet, str]],
                   router: str) -> DataParallelMetrics:
        """The metrics of several pools behind one front (P/D: the prefill pool, then the decode pool), each
        ``(replicas, replica_set, role)``: replica ids run over the pools in order, each replica's summary carries
        its pool's ``role``.

        Raises:
            ValueError: no pool.
        """
        if not pools:
            raise ValueError("DataParallelMetrics.over_pools needs at least one pool")
        metrics = cls(front, pools[0][0], pools[0][1], router)
        metrics._pools = [(list(replicas), replica_set, role) for replicas, replica_set, role in pools]
        return metrics

    @property
    def _replicas(self) -> list[ReplicaEngine]:
        """Every pool's replicas, in order."""
        return [replica for replicas, _, _ in self._pools for replica in replicas]

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
        """Per replica: ``replica_id``, ``role`` (``both``; P/D: ``prefill`` or ``decode``), ``alive``,
        ``num_routed`` (requests its pool's router sent it), ``prefix_cache_hit_rate`` (hit / queried prompt tokens
        over its admissions) and :data:`REPLICA_KEYS`."""
        out = []
        for replicas, replica_set, pool_role in self._pools:
            for i, replica in enumerate(replicas):
                summary = replica.metrics.summary(duration_s)
                kv = replica.kv_allocator.stats()
                out.append({"replica_id": len(out), "role": pool_role or replica_set.roles[i], "alive": replica_set.alive[i],
                            "num_routed": replica_set.num_routed[i], "prefix_cache_hit_rate": kv.hit_rate,
                            "prefix_queries_tokens": kv.prefix_queries_tokens,
                            "prefix_hits_tokens": kv.prefix_hits_tokens, **{k: summary[k] for k in REPLICA_KEYS}})
        return out

    def summary(self, duration_s: float | None = None) -> dict[str, Any]:
        """``MetricsCollector.summary``'s keys over the whole front, plus ``data_parallel_size``, ``router``,
        ``replicas`` (:meth:`replica_summaries`) and ``load_imbalance`` (max / mean requests routed per live
        replica; 1.0 is perfectly even).

        Request latencies and throughputs come from every finished request; ``prefix_cache_hit_rate`` is hit /
        queried tokens summed over replicas; step counts, preemptions and a KV connector's
        ``external_prefix_cache_queries`` / ``external_prefix_cache_hits`` (tokens) are sums; its transfers
        (``num_kv_transfers``, ``kv_transfer_bytes``, ...) are every replica's together; KV usage and concurrency
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
            external_prefix_cache_queries=sum(r["external_prefix_cache_queries"] for r in replicas),
            external_prefix_cache_hits=sum(r["external_prefix_cache_hits"] for r in replicas),
            data_parallel_size=len(replicas), router=self._router, replicas=replicas)
        out.update(kv_transfer_summary([r.metrics for r in self._replicas]))
        routed = [r["num_routed"] for r in replicas if r["alive"]]
        out["load_imbalance"] = max(routed) / (sum(routed) / len(routed)) if routed and sum(routed) else 1.0
        return out
