"""vLLM's speculative-decoding counters on ``/metrics`` without a server (``servelab:spec_decode_num_drafts_total``,
``..._num_draft_tokens_total``, ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}``):
each publication adds what a replica added since its previous one, and a Medusa-tree engine's publication equals its
``metrics.json`` totals (per-position counts are the per-depth acceptances)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from helpers import STORIES  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from framework import SamplingParams  # noqa: E402
from framework.engine.core import replica_stats  # noqa: E402
from framework.engine.core_messages import ReplicaStats  # noqa: E402
from framework.entrypoints.server.metrics import ServerMetrics  # noqa: E402

NAMES = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _values(metrics: ServerMetrics) -> dict:
    """``{name: value}`` of the spec-decode totals and ``{("per_pos", position): value}``."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if not sample.name.startswith("servelab:spec_decode_") or not sample.name.endswith("_total"):
                continue
            name = sample.name.removeprefix("servelab:spec_decode_").removesuffix("_total")
            out[("per_pos", int(sample.labels["position"])) if "position" in sample.labels else name] = sample.value
    return out


def test_counters_add_each_replicas_increments():
    metrics = ServerMetrics("tiny", data_parallel_size=2)
    metrics.observe_stats(ReplicaStats(0, spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=3,
                                       spec_accepted_per_pos=[2, 1]))
    metrics.observe_stats(ReplicaStats(1, spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=1,
                                       spec_accepted_per_pos=[1]))
    metrics.observe_stats(ReplicaStats(0, spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=6,
                                       spec_accepted_per_pos=[3, 2, 1]))
    assert _values(metrics) == {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 7,
                                ("per_pos", 0): 4, ("per_pos", 1): 2, ("per_pos", 2): 1}


def test_zero_without_speculation():
    metrics = ServerMetrics("tiny")
    metrics.observe_stats(ReplicaStats(0))
    assert _values(metrics) == dict.fromkeys(NAMES, 0.0)


def test_medusa_tree_engine_publication_equals_its_summary(make_llm):
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    llm = make_llm(drafter="medusa", drafter_params={"model": str(Path(STORIES).parent / "stories260K-medusa"),
                                                     "tree": tree})
    llm.generate(["Once upon a time", "The dog ran to the park and"], SamplingParams(temperature=0.0, max_tokens=32))
    metrics = ServerMetrics("stories")
    for stats in replica_stats(llm.engine):
        metrics.observe_stats(stats)
    values, summary = _values(metrics), llm.engine.metrics.summary()
    assert values["num_draft_tokens"] == summary["spec_num_draft_tokens"]
    assert values["num_accepted_tokens"] == summary["spec_num_accepted_tokens"] > 0
    mean_length = (values["num_accepted_tokens"] + values["num_drafts"]) / values["num_drafts"]
    assert mean_length == pytest.approx(summary["spec_mean_accepted_length"])
    per_pos = [values[("per_pos", i)] for i in range(len(summary["spec_acceptance_by_position"]))]
    assert sum(per_pos) == values["num_accepted_tokens"] and len(per_pos) > 1
