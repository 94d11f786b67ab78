"""``servelab:lora_requests_info`` without a server: one series whose labels are the live replicas' running and waiting
adapters (vLLM's ``vllm:lora_requests_info``), value the publication's Unix time; absent without LoRA."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from framework.engine.core_messages import ReplicaStats  # noqa: E402
from framework.entrypoints.server.metrics import ServerMetrics  # noqa: E402


def _samples(metrics: ServerMetrics) -> list:
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    family = families.get("servelab:lora_requests_info")
    return [] if family is None else family.samples


def test_one_series_of_the_live_replicas_adapters():
    metrics = ServerMetrics("tiny", data_parallel_size=2, max_loras=2)
    metrics.observe_stats(ReplicaStats(0, running_lora_adapters=["a1"], waiting_lora_adapters=["a2"]))
    metrics.observe_stats(ReplicaStats(1, running_lora_adapters=["a1", "a3"]))
    [sample] = _samples(metrics)
    assert sample.labels == {"model_name": "tiny", "max_lora": "2", "running_lora_adapters": "a1,a3",
                             "waiting_lora_adapters": "a2"}
    assert abs(sample.value - time.time()) < 60
    metrics.observe_stats(ReplicaStats(1, alive=False, running_lora_adapters=["a3"]))  # a dead replica drops out
    [sample] = _samples(metrics)
    assert (sample.labels["running_lora_adapters"], sample.labels["waiting_lora_adapters"]) == ("a1", "a2")


def test_no_gauge_without_lora():
    metrics = ServerMetrics("tiny")
    metrics.observe_stats(ReplicaStats(0))
    assert _samples(metrics) == []
