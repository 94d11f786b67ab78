"""Request metrics and the run summary, on synthetic requests with hand-set timestamps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from rich.console import Console
from rich.table import Table

from framework.core.outputs import CompletionOutput, RequestOutput, SchedulerStats
from framework.core.request import Request, RequestStatus
from framework.core.sampling_params import SamplingParams
from framework.metrics.collector import MetricsCollector, compute_request_metrics, percentile, render_summary_table


def make_request(rid, prompt_len, arrival, scheduled, token_times, status=RequestStatus.FINISHED_LENGTH):
    """A finished request whose output tokens were produced at ``token_times`` (seconds)."""
    req = Request(request_id=rid, prompt_token_ids=list(range(3, 3 + prompt_len)), sampling_params=SamplingParams(),
                  arrival_time=arrival)
    req.times.first_scheduled_s = scheduled
    for i, t in enumerate(token_times):
        req.append_output_token(10 + i)
        req.times.token_s.append(t)
    req.times.first_token_s = token_times[0] if token_times else None
    req.times.finished_s = token_times[-1] if token_times else scheduled
    req.status = status
    return req


def as_output(req, error=None):
    completion = CompletionOutput(index=0, text="", token_ids=list(req.output_token_ids),
                                  finish_reason=req.finish_reason)
    return RequestOutput(request_id=req.request_id, prompt=None, prompt_token_ids=req.prompt_token_ids,
                         outputs=[completion], finished=True, metrics=compute_request_metrics(req), error=error)


# A: arrives 0, scheduled 0.5, tokens at 1.0/1.2/1.6 -> TTFT 1.0, TPOT 0.3, ITL [0.2, 0.4], e2e 1.6, queue 0.5
# B: arrives 1.0, scheduled 1.0, one token at 1.5  -> TTFT 0.5, no TPOT, no ITL, e2e 0.5, queue 0
REQ_A = dict(rid="a", prompt_len=4, arrival=0.0, scheduled=0.5, token_times=[1.0, 1.2, 1.6])
REQ_B = dict(rid="b", prompt_len=2, arrival=1.0, scheduled=1.0, token_times=[1.5])


def stats(step, usage, hit_rate, preemptions):
    return SchedulerStats(step=step, num_running_reqs=1, num_waiting_reqs=0, num_scheduled_tokens=4,
                          num_prefill_tokens=3, num_decode_tokens=1, kv_cache_usage=usage,
                          prefix_cache_hit_rate=hit_rate, num_preemptions=preemptions, schedule_s=0.1, prepare_s=0.2,
                          forward_s=0.5, sample_s=0.1, update_s=0.1, step_s=1.0, num_generated_tokens=1)


def test_compute_request_metrics():
    m = compute_request_metrics(make_request(**REQ_A))
    assert m.ttft_s == pytest.approx(1.0) and m.tpot_s == pytest.approx(0.3)
    assert m.itl_s == pytest.approx([0.2, 0.4])
    assert m.e2e_s == pytest.approx(1.6) and m.queue_s == pytest.approx(0.5)
    assert (m.num_prompt_tokens, m.num_output_tokens, m.num_preemptions) == (4, 3, 0)
    single = compute_request_metrics(make_request(**REQ_B))
    assert single.tpot_s is None and single.itl_s == [] and single.ttft_s == pytest.approx(0.5)


def test_never_scheduled_request_has_no_latencies():
    req = Request(request_id="x", prompt_token_ids=[5, 6], sampling_params=SamplingParams(), arrival_time=0.0)
    req.status = RequestStatus.FINISHED_ABORTED
    m = compute_request_metrics(req)
    assert (m.ttft_s, m.tpot_s, m.e2e_s, m.queue_s, m.itl_s) == (None, None, None, None, [])


def test_percentile_matches_numpy_linear():
    assert percentile([500.0, 1000.0], 99) == pytest.approx(995.0)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def collector(**slo):
    c = MetricsCollector(**slo)
    c.observe_step(stats(0, usage=0.3, hit_rate=0.1, preemptions=1))
    c.observe_step(stats(1, usage=0.7, hit_rate=0.25, preemptions=2))
    c.observe_finished(as_output(make_request(**REQ_A)))
    c.observe_finished(as_output(make_request(**REQ_B)))
    rejected = make_request("c", 3, 0.0, 0.0, [], status=RequestStatus.FINISHED_ABORTED)
    c.observe_finished(as_output(rejected, error="prompt too long"))
    return c


def test_summary_hand_checked():
    s = collector().summary(duration_s=2.0)
    assert (s["num_requests"], s["num_failed"], s["num_steps"]) == (2, 1, 2)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (6, 4)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(5.0)
    assert s["request_goodput"] is None  # no SLO given
    # TTFT [1000, 500] ms
    assert s["mean_ttft_ms"] == pytest.approx(750) and s["median_ttft_ms"] == pytest.approx(750)
    assert s["std_ttft_ms"] == pytest.approx(250)
    assert s["p90_ttft_ms"] == pytest.approx(950) and s["p99_ttft_ms"] == pytest.approx(995)
    # TPOT only from A (B has one token)
    assert s["mean_tpot_ms"] == pytest.approx(300) and s["p99_tpot_ms"] == pytest.approx(300)
    # ITL pooled [200, 400]
    assert s["mean_itl_ms"] == pytest.approx(300) and s["p90_itl_ms"] == pytest.approx(380)
    # e2e [1600, 500]
    assert s["mean_e2el_ms"] == pytest.approx(1050) and s["p99_e2el_ms"] == pytest.approx(1589)
    assert s["mean_queue_ms"] == pytest.approx(250)
    assert s["peak_kv_cache_usage"] == pytest.approx(0.7)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)  # last step's cumulative value
    assert s["num_preemptions"] == 3
    assert s["step_s"] == pytest.approx(2.0)
    assert s["schedule_s"] == pytest.approx(0.2) and s["schedule_frac"] == pytest.approx(0.1)
    assert s["forward_s"] == pytest.approx(1.0) and s["forward_frac"] == pytest.approx(0.5)
    assert s["prepare_frac"] == pytest.approx(0.2) and s["sample_frac"] == pytest.approx(0.1)
    assert s["update_frac"] == pytest.approx(0.1)
    json.dumps(s)  # JSON-serializable as is


@pytest.mark.parametrize("slo, goodput", [
    (dict(slo_ttft_ms=800), 0.5),  # A misses TTFT (1000 ms)
    (dict(slo_tpot_ms=250), 0.5),  # A misses TPOT (300 ms); B has no TPOT and meets it
    (dict(slo_ttft_ms=1200, slo_tpot_ms=350), 1.0),  # both meet both
    (dict(slo_ttft_ms=800, slo_tpot_ms=250), 0.5),
])
def test_goodput_distserve(slo, goodput):
    """Requests meeting every SLO, per second (2 s run); the rejected request never counts."""
    assert collector(**slo).summary(duration_s=2.0)["request_goodput"] == pytest.approx(goodput)


def test_empty_summary_and_default_duration():
    empty = MetricsCollector().summary()
    assert empty["num_requests"] == 0 and empty["duration_s"] == 0.0 and empty["mean_ttft_ms"] is None
    assert empty["request_throughput"] == 0.0
    s = collector().summary()
    # from the first step's start (its observation minus step_s = 1.0) to the last observation
    assert 1.0 <= s["duration_s"] < 1.5


def test_render_summary_table():
    s = collector(slo_ttft_ms=800).summary(duration_s=2.0)
    s["num_rejected"] = 0
    table = render_summary_table(s)
    assert isinstance(table, Table)
    console = Console(record=True, width=160)
    console.print(table)
    text = console.export_text()
    for needle in ("request_throughput", "num_rejected", "ttft ms", "750.0", "995.0", "request_goodput",
                   "forward_s", "(50.0%)"):
        assert needle in text


def test_a_bounded_collector_keeps_a_window_of_records_and_exact_totals():
    """A server's collector (``max_records``): percentiles and the timeline cover the latest records,
    counts, token totals, throughput and goodput cover every request."""
    bounded, full = MetricsCollector(slo_ttft_ms=800, max_records=1), MetricsCollector(slo_ttft_ms=800)
    for c in (bounded, full):
        c.observe_step(stats(1, 0.5, 0.0, 1))
        c.observe_step(stats(2, 0.7, 0.25, 2))
        for spec in (REQ_A, REQ_B):
            c.observe_finished(as_output(make_request(**spec)))
    s, f = bounded.summary(duration_s=2.0), full.summary(duration_s=2.0)
    assert len(bounded.completed) == 1 and len(bounded.timeline) == 1 and len(full.timeline) == 2
    for key in ("num_requests", "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
                "num_steps", "num_preemptions"):
        assert s[key] == f[key], key
    assert s["mean_ttft_ms"] == pytest.approx(500) and f["mean_ttft_ms"] == pytest.approx(750)  # B only vs A and B


def test_acceptance_by_position_is_conditional_on_the_earlier_drafts():
    collector = MetricsCollector()
    collector.observe_step(SchedulerStats(step=0, num_running_reqs=3, num_waiting_reqs=0, num_scheduled_tokens=9,
                                          num_prefill_tokens=9, num_decode_tokens=0, kv_cache_usage=0.1,
                                          prefix_cache_hit_rate=0.0, num_preemptions=0, num_spec_reqs=3,
                                          num_draft_tokens=6, num_accepted_tokens=3))
    # a: 2 of 2 accepted; b: first rejected; c: first accepted, second rejected
    collector.observe_draft_positions({"a": [1, 2], "b": [3, 4], "c": [5, 6]}, {"a": 2, "c": 1})
    summary = collector.summary()
    assert summary["spec_acceptance_by_position"] == [2 / 3, 1 / 2]  # position 1 reached by a and c only
    assert summary["spec_acceptance_rate"] == 0.5


def test_kv_transfers_hand_checked():
    """Two transfers in one step (counted at their mean), one in another, none in a third."""
    import dataclasses

    c = MetricsCollector()
    c.observe_step(dataclasses.replace(stats(0, 0.1, 0.0, 0), num_kv_transfers=2, kv_transfer_bytes=3000,
                                       kv_transfer_s=0.004))
    c.observe_step(dataclasses.replace(stats(1, 0.1, 0.0, 0), num_kv_transfers=1, kv_transfer_bytes=1000,
                                       kv_transfer_s=0.002))
    c.observe_step(stats(2, 0.1, 0.0, 0))
    s = c.summary()
    assert (s["num_kv_transfers"], s["kv_transfer_bytes"]) == (3, 4000)
    assert s["kv_transfer_s"] == pytest.approx(0.006) and s["kv_transfer_gb_per_s"] == pytest.approx(4000 / 0.006 / 1e9)
    assert s["mean_kv_transfer_ms"] == pytest.approx(2.0) and s["median_kv_transfer_ms"] == pytest.approx(2.0)
    assert s["mean_kv_transfer_bytes"] == pytest.approx(4000 / 3)
    empty = MetricsCollector().summary()
    assert empty["num_kv_transfers"] == 0 and empty["kv_transfer_gb_per_s"] is None and empty["p99_kv_transfer_ms"] is None


def test_reset_zeroes_the_counters_and_keeps_what_the_engine_set():
    """A benchmark resets after its warm-up: counters and records go, the engine's build-time fields stay (a later
    ``engine.compile=auto`` compile reads ``compile_stats``; the summary reports the model and KV cache)."""
    c = MetricsCollector(slo_ttft_ms=800, max_records=5)
    c.model_info, c.kv_cache_info = {"dtype": "float32"}, {"kv_cache_num_blocks": 7}
    c.compile_stats, c.compile_info = SimpleNamespace(enabled=False), {"compile_mode": "auto"}
    c.run_labels = {"simulated": True, "sim_profile": None}
    engine_set = {name: getattr(c, name) for name in MetricsCollector._ENGINE_SET}
    c.observe_step(stats(1, 0.5, 0.0, 1))
    c.observe_finished(as_output(make_request(**REQ_A)))
    c.reset()
    assert c.num_steps == 0 and not c.completed and not c.timeline and c.summary()["num_requests"] == 0
    assert c.slo_ttft_ms == 800 and c.max_records == 5
    assert all(getattr(c, name) is value for name, value in engine_set.items())
