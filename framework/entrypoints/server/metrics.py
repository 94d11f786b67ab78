"""Prometheus metrics of the server: vLLM's ``vllm:*`` set under the ``servelab:`` prefix.

Fed by the API front (:class:`~framework.engine.async_llm.AsyncLLM`) from what the engine cores publish with every
step (:class:`~framework.engine.core_messages.ReplicaStats`: load and cumulative counters) and from each request's
final output, so the same metrics come out whether the engine core runs in this process or its own. Updates run on
the front's client threads; ``prometheus_client`` metrics are thread-safe. Every metric carries the ``model_name``
label, as vLLM's.

Differences from vLLM, by design: TTFT/ITL/queue-time histograms are observed when a request
finishes (from its ``RequestMetrics``), not as each token arrives; ``prompt_tokens`` counts a
request's prompt once, when it finishes (aborted requests included).
"""

from __future__ import annotations

import time
from typing import Any

from framework.core.outputs import RequestOutput
from framework.engine.core_messages import ReplicaStats

PREFIX = "servelab:"
# histogram buckets, seconds (vLLM's defaults, shortened at the top end)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_KV_TRANSFER_BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 34, 2))  # 64 KiB .. 4 GiB, x4 apart
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)


class ServerMetrics:
    """The server's Prometheus metrics, in their own ``CollectorRegistry`` (several apps per process work).

    Pass it as ``AsyncLLM(..., metrics=...)``: the front calls :meth:`observe_stats` and :meth:`observe_finished`.
    Metric names (``servelab:`` + vLLM's name):

    * gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc`` (fraction of
      KV blocks in use, [0, 1], as vLLM despite the name);
    * counters ``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (tokens),
      ``external_prefix_cache_queries_total`` / ``external_prefix_cache_hits_total`` (a KV connector's, tokens),
      ``prompt_tokens_total``, ``generation_tokens_total`` (tokens), ``num_preemptions_total``,
      ``request_success_total{finished_reason}`` (``stop``/``length``/``abort``);
    * speculative decoding (vLLM's names): counters ``spec_decode_num_drafts_total`` (verify steps of requests
      with drafts), ``spec_decode_num_draft_tokens_total`` (draft tokens or tree nodes verified),
      ``spec_decode_num_accepted_tokens_total`` and ``spec_decode_num_accepted_tokens_per_pos_total{position}``
      (accepted drafts at each draft position; for token trees ``position`` is the tree depth - 1, as vLLM
      counts chain positions from 0);
    * a KV connector's transfers (``zmq`` pulls): histograms ``kv_transfer_bytes`` (bytes per transfer) and
      ``kv_transfer_seconds`` (seconds per transfer), from the records each replica publication adds (at most
      ``RECENT_KV_TRANSFERS`` per publication; ``metrics.json``'s ``kv_transfer_*`` are their offline counterparts);
    * histograms (seconds) ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
      ``e2e_request_latency_seconds``, ``request_queue_time_seconds``,
      ``request_time_per_output_token_seconds``;
    * with data-parallel replicas (``parallel.data_parallel_size > 1``) the gauges above sum the live replicas,
      and ``replica_alive``, ``replica_num_requests_running``, ``replica_num_requests_waiting``,
      ``replica_kv_cache_usage_perc``, ``replica_num_requests_routed`` carry a ``replica`` label;
    * with LoRA (``max_loras`` given), vLLM's info gauge ``lora_requests_info``: labels ``running_lora_adapters``
      and ``waiting_lora_adapters`` (adapter names, comma-separated, sorted) and ``max_lora``, value the Unix
      time of the publication (seconds). Unlike vLLM, one series only: the previous label set is dropped on
      every update, so the series count stays 1 however many adapters come and go.

    Args:
        model_name: value of the ``model_name`` label.
        data_parallel_size: replicas behind the front; the per-replica gauges exist when it is > 1.
        max_loras: ``lora.max_loras`` when the engine serves LoRA adapters (the gauge exists), else None.
    """

    def __init__(self, model_name: str, data_parallel_size: int = 1, max_loras: int | None = None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("num_requests_running", "Requests holding KV blocks (in model execution batches).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use, [0, 1].")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix-cache queries, tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix-cache hits, tokens.")
        self.external_queries = counter("external_prefix_cache_queries", "KV connector queries, tokens.")
        self.external_hits = counter("external_prefix_cache_hits", "KV connector hits, tokens.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative preemptions.")
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token, s.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency, s.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency, s.", _E2E_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before first scheduled, s.", _E2E_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Time per output token after the first, s.",
                              _ITL_BUCKETS)
        self.kv_transfer_bytes = histogram("kv_transfer_bytes", "KV connector transfer size, bytes.",
                                           _KV_TRANSFER_BYTES_BUCKETS)
        self.kv_transfer_seconds = histogram("kv_transfer_seconds", "KV connector transfer time, s.", _TTFT_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Verify steps of requests with drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens (tree nodes) verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted per position (tree depth - 1).",
                                             ["model_name", "position"], registry=self.registry)
        self._last: dict[int, ReplicaStats] = {}  # replica id -> its previous publication (counter deltas)
        self.max_loras = max_loras
        self.lora_info = None if max_loras is None else Gauge(
            PREFIX + "lora_requests_info", "Running and waiting LoRA adapters (labels); value: Unix time, s.",
            ["model_name", "max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=self.registry)
        self.data_parallel_size = data_parallel_size
        if data_parallel_size > 1:
            def per_replica(name: str, doc: str) -> Any:
                return Gauge(PREFIX + "replica_" + name, doc, ["model_name", "replica"], registry=self.registry)

            self.replica_gauges = {
                "alive": per_replica("alive", "1 while the data-parallel replica serves, 0 once it died."),
                "running": per_replica("num_requests_running", "Requests in the replica's running batch."),
                "waiting": per_replica("num_requests_waiting", "Requests waiting on the replica."),
                "kv_usage": per_replica("kv_cache_usage_perc", "The replica's KV-cache usage, [0, 1]."),
                "routed": per_replica("num_requests_routed", "Requests the router sent to the replica so far.")}

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (``/metrics`` body)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def observe_stats(self, stats: ReplicaStats) -> None:
        """One replica's publication: counters grow by what it added since its previous one, gauges are set
        (summed over live replicas)."""
        last = self._last.get(stats.replica_id)
        for counter, field in ((self.generation_tokens, "num_generated_tokens"), (self.preemptions, "num_preemptions"),
                               (self.prefix_queries, "prefix_queries_tokens"), (self.prefix_hits, "prefix_hits_tokens"),
                               (self.external_queries, "external_prefix_queries_tokens"),
                               (self.external_hits, "external_prefix_hits_tokens"),
                               (self.spec_drafts, "spec_num_drafts"), (self.spec_draft_tokens, "spec_num_draft_tokens"),
                               (self.spec_accepted, "spec_num_accepted_tokens")):
            delta = getattr(stats, field) - (getattr(last, field) if last is not None else 0)
            if delta > 0:
                counter.inc(delta)
        before = last.spec_accepted_per_pos if last is not None else []
        for pos, total in enumerate(stats.spec_accepted_per_pos):
            series = self.spec_accepted_per_pos.labels(self.model_name, str(pos))  # exists at 0 once reached
            delta = total - (before[pos] if pos < len(before) else 0)
            if delta > 0:
                series.inc(delta)
        new_transfers = stats.num_kv_transfers - (last.num_kv_transfers if last is not None else 0)
        for size, seconds in stats.recent_kv_transfers[max(0, len(stats.recent_kv_transfers) - new_transfers):]:
            self.kv_transfer_bytes.observe(size)
            self.kv_transfer_seconds.observe(seconds)
        self._last[stats.replica_id] = stats
        live = [s for s in self._last.values() if s.alive]
        self.running.set(sum(s.num_running_reqs for s in live))
        self.waiting.set(sum(s.num_waiting_reqs for s in live))
        self.kv_usage.set(sum(s.kv_cache_usage for s in live) / len(live) if live else 0.0)
        if self.lora_info is not None:
            self._observe_loras(live)
        if self.data_parallel_size > 1:
            replica = (self.model_name, str(stats.replica_id))
            self.replica_gauges["alive"].labels(*replica).set(1 if stats.alive else 0)
            self.replica_gauges["running"].labels(*replica).set(stats.num_running_reqs)
            self.replica_gauges["waiting"].labels(*replica).set(stats.num_waiting_reqs)
            self.replica_gauges["kv_usage"].labels(*replica).set(stats.kv_cache_usage)
            self.replica_gauges["routed"].labels(*replica).set(stats.num_routed)

    def _observe_loras(self, live: list[ReplicaStats]) -> None:
        """``lora_requests_info``: the live replicas' running and waiting adapters, now (one series)."""
        running = ",".join(sorted({name for s in live for name in s.running_lora_adapters}))
        waiting = ",".join(sorted({name for s in live for name in s.waiting_lora_adapters}))
        self.lora_info.clear()
        self.lora_info.labels(self.model_name, str(self.max_loras), waiting, running).set(time.time())

    def observe_finished(self, output: RequestOutput) -> None:
        """Per finished request: success counter, prompt tokens, latency histograms."""
        reason = output.outputs[0].finish_reason if output.outputs else "abort"
        self._success.labels(self.model_name, reason or "abort").inc()
        m = output.metrics
        if m is not None:
            self.prompt_tokens.inc(m.num_prompt_tokens)
            for hist, value in ((self.ttft, m.ttft_s), (self.e2e, m.e2e_s), (self.queue, m.queue_s),
                                (self.tpot, m.tpot_s)):
                if value is not None:
                    hist.observe(value)
            for gap in m.itl_s:
                self.itl.observe(gap)
