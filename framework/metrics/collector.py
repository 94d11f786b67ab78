"""Run metrics: per-request latencies and a run summary with vLLM ``benchmark_serving`` names.

Definitions (vLLM / SGLang benchmarks):

* TTFT  = first token - arrival; TPOT = (finish - first token) / (n_out - 1), only for n_out >= 2;
  ITL = gaps between consecutive output tokens (all requests' gaps pooled); e2e latency (``e2el``)
  = finish - arrival; queue = first scheduled - arrival.
* goodput = completed requests per second that meet every given SLO (DistServe, Zhong et al.,
  OSDI'24, Sec. 2); a request with fewer than two output tokens has no TPOT and meets a TPOT SLO.

Latencies are reported in milliseconds (``*_ms``), throughputs per second of ``duration_s``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table

from framework.core.clock import WALL_CLOCK, Clock
from framework.core.outputs import RequestMetrics, RequestOutput, SchedulerStats

if TYPE_CHECKING:
    from framework.core.request import Request

STEP_PARTS = ("schedule", "prepare", "forward", "sample", "update")  # SchedulerStats.<part>_s
LATENCIES = ("ttft", "tpot", "itl", "e2el", "queue")
STATS = ("mean", "median", "std", "p90", "p99")
_SWAP_COUNTERS = ("num_preemptions_swap", "num_swap_out_blocks", "num_swap_in_blocks", "swapped_bytes")


def compute_request_metrics(request: Request, kv_block_bytes: int = 0) -> RequestMetrics:
    """Latency metrics of one (normally finished) request from its ``request.times``, seconds, and the KV it
    held at its last step and at its peak (``request.kv_blocks``, ``request.peak_kv_blocks`` per KV cache
    group; ``kv_block_bytes``: bytes per block).

    A missing timestamp gives ``None`` for the metrics that need it (e.g. an aborted request that
    was never scheduled has no TTFT or queue time).
    """
    t = request.times
    n_out = request.num_output_tokens
    ttft = None if t.first_token_s is None else t.first_token_s - t.arrival_s
    tpot = None
    if n_out >= 2 and t.first_token_s is not None and t.finished_s is not None:
        tpot = (t.finished_s - t.first_token_s) / (n_out - 1)
    return RequestMetrics(
        ttft_s=ttft,
        tpot_s=tpot,
        itl_s=[b - a for a, b in zip(t.token_s, t.token_s[1:])],
        e2e_s=None if t.finished_s is None else t.finished_s - t.arrival_s,
        queue_s=None if t.first_scheduled_s is None else t.first_scheduled_s - t.arrival_s,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=n_out,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        kv_blocks=list(request.kv_blocks),
        kv_bytes=sum(request.kv_blocks) * kv_block_bytes,
        peak_kv_bytes=sum(request.peak_kv_blocks) * kv_block_bytes,
    )


def percentile(values: list[float], q: float) -> float:
    """``q``-th percentile (0..100) with linear interpolation, as ``numpy.percentile``'s default.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _describe(values_s: list[float]) -> dict[str, float | None]:
    """mean/median/std (population)/p90/p99 of ``values_s`` in ms; ``None`` each when empty."""
    if not values_s:
        return dict.fromkeys(STATS)
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    return {"mean": mean, "median": percentile(ms, 50), "std": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),
            "p90": percentile(ms, 90), "p99": percentile(ms, 99)}


class MetricsCollector:
    """Accumulates per-step stats and finished requests of one run; :meth:`summary` reduces them.

    The engine calls :meth:`observe_step` after each step that scheduled work and
    :meth:`observe_finished` once per request that reached a terminal state.

    Args:
        slo_ttft_ms: TTFT SLO for goodput, ms; ``None`` = no TTFT constraint.
        slo_tpot_ms: TPOT SLO for goodput, ms; ``None`` = no TPOT constraint.
        max_records: keep only the latest this many finished requests and step records (a server
            runs for days: its latency percentiles and ``timeline`` then cover that recent window,
            while counts, token totals, throughputs and goodput stay exact); ``None`` keeps all (an
            offline run).
    """

    def __init__(self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                 max_records: int | None = None) -> None:
        self.slo_ttft_ms = slo_ttft_ms
        self.slo_tpot_ms = slo_tpot_ms
        self.max_records = max_records
        # exact over every completed request, whatever max_records keeps
        self._totals = dict.fromkeys(("num_requests", "total_input_tokens", "total_output_tokens", "total_cached_tokens",
                                      "sum_kv_bytes", "max_kv_bytes_per_request", "max_peak_kv_bytes_per_request",
                                      "num_meeting_slo"), 0)
        self.completed: deque[RequestMetrics] = deque(maxlen=max_records)  # finish_reason stop/length, no error
        self.num_failed = 0  # aborted or rejected requests seen by the engine
        self.num_steps = 0
        self.step_time_s = dict.fromkeys((*STEP_PARTS, "step"), 0.0)  # totals, seconds
        self.peak_kv_cache_usage = 0.0
        self.sum_kv_cache_usage = 0.0  # summed over steps (mean = sum / num_steps)
        self.sum_kv_cache_fragmentation = 0.0
        self.sum_num_running_reqs = 0
        self.peak_num_running_reqs = 0  # concurrency: requests holding KV in one step
        self.swap_totals = dict.fromkeys(_SWAP_COUNTERS, 0)  # swap preemption counters, summed
        # per step: time_s, running, waiting, kv usage, fragmentation
        self.timeline: deque[dict[str, float]] = deque(maxlen=max_records)
        self.prefix_cache_hit_rate = 0.0  # last step's cumulative value
        # KV connector: last step's cumulative external prefix-cache queries and hits, tokens
        self.external_prefix_cache = dict.fromkeys(("external_prefix_cache_queries", "external_prefix_cache_hits"), 0)
        # KV connector transfers (pulls, loads): (bytes, seconds) per transfer; those finishing in one step count at
        # their mean (the stats carry the step's sums); totals exact
        self.kv_transfers: deque[tuple[float, float]] = deque(maxlen=max_records)
        self.kv_transfer_totals = {"num_kv_transfers": 0, "kv_transfer_bytes": 0, "kv_transfer_s": 0.0}
        self.num_preemptions = 0
        self.model_info: dict[str, Any] = {}  # set by build_engine: dtype, dtype_reason
        self.kv_cache_info: dict[str, Any] = {}  # set by build_engine: kv_cache_{dtype,num_blocks,bytes_per_block,...}
        self.compile_stats: Any = None  # framework.compilation.decoder.CompileStats, set by build_engine; live (recompiles grow)
        # expert parallelism: as_dict() -> {"expert_load": per MoE layer, per expert token counts}, set by build_engine
        self.expert_load: Any = None
        self.compile_info: dict[str, Any] = {}  # compile_mode (auto|true|false), compile_reason: set by the engine
        self.num_generated_tokens = 0  # output tokens over all steps
        self.num_sampled_reqs = 0  # (request, step) pairs that produced tokens: target forwards per request
        # speculative decoding totals (SchedulerStats field names)
        self.spec = dict.fromkeys(("num_spec_reqs", "num_draft_tokens", "num_accepted_tokens", "draft_s"), 0)
        self.spec_verify_s = 0.0  # forward + sample time of steps that verified drafts, seconds
        # per draft position i: [verified (positions < i all accepted), accepted]; executor=sim's acceptance traces
        self.spec_positions: list[list[int]] = []
        self.clock: Clock = WALL_CLOCK  # the engine's clock (a simulator's virtual one), set by the engine
        # labels every record of the run carries (Executor.run_labels: simulated, sim_profile), set by the engine
        self.run_labels: dict[str, Any] = {"simulated": False, "sim_profile": None}
        self._first_s: float | None = None  # clock reading at the start of the first observed step
        self._last_s: float | None = None  # clock reading at the last observation

    # what the engine sets once at build or start (not counters): kept by reset()
    _ENGINE_SET = ("model_info", "kv_cache_info", "compile_stats", "expert_load", "compile_info", "clock", "run_labels")

    def reset(self) -> None:
        """Zero every counter and record (e.g. after a benchmark's warm-up), keeping what the engine set at build and
        start: model and KV cache info, the live compile stats and expert load, the compile decision, the clock and
        the run labels (re-running ``__init__`` dropped them: a later ``engine.compile=auto`` compile then failed on
        the missing compile stats)."""
        kept = {name: getattr(self, name) for name in self._ENGINE_SET}
        self.__init__(self.slo_ttft_ms, self.slo_tpot_ms, self.max_records)
        self.__dict__.update(kept)

    def _touch(self, start_s: float) -> None:
        now = self.clock.now()
        self._first_s = start_s if self._first_s is None else min(self._first_s, start_s)
        self._last_s = now

    def _observe_kv_transfers(self, stats: SchedulerStats) -> None:
        """Add the KV connector transfers the step's stats report (sums over ``num_kv_transfers`` transfers)."""
        n = stats.num_kv_transfers
        if not n:
            return
        self.kv_transfers.extend([(stats.kv_transfer_bytes / n, stats.kv_transfer_s / n)] * n)
        for key in self.kv_transfer_totals:
            self.kv_transfer_totals[key] += getattr(stats, key)

    def _kv_transfer_summary(self) -> dict[str, Any]:
        """``metrics.json``'s KV transfer keys (see :meth:`summary`)."""
        return kv_transfer_summary([self])

    def observe_step(self, stats: SchedulerStats) -> None:
        """Add one step's stats (time split, KV usage, preemptions)."""
        self._touch(self.clock.now() - stats.step_s)
        self.num_steps += 1
        for part in STEP_PARTS:
            self.step_time_s[part] += getattr(stats, f"{part}_s")
        self.step_time_s["step"] += stats.step_s
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, stats.kv_cache_usage)
        self.sum_kv_cache_usage += stats.kv_cache_usage
        self.sum_kv_cache_fragmentation += stats.kv_cache_fragmentation
        self.sum_num_running_reqs += stats.num_running_reqs
        self.peak_num_running_reqs = max(self.peak_num_running_reqs, stats.num_running_reqs)
        self.timeline.append({"step": stats.step, "time_s": self._last_s - self._first_s,
                              "num_running_reqs": stats.num_running_reqs, "num_waiting_reqs": stats.num_waiting_reqs,
                              "kv_cache_usage": stats.kv_cache_usage,
                              "kv_cache_fragmentation": stats.kv_cache_fragmentation,
                              "num_preemptions": stats.num_preemptions})
        self.prefix_cache_hit_rate = stats.prefix_cache_hit_rate
        for key in self.external_prefix_cache:
            self.external_prefix_cache[key] = getattr(stats, key)
        self.num_preemptions += stats.num_preemptions
        self._observe_kv_transfers(stats)
        for key in _SWAP_COUNTERS:
            self.swap_totals[key] += getattr(stats, key)
        self.num_generated_tokens += stats.num_generated_tokens
        self.num_sampled_reqs += stats.num_sampled_reqs
        for key in self.spec:
            self.spec[key] += getattr(stats, key)
        if stats.num_draft_tokens:
            self.spec_verify_s += stats.forward_s + stats.sample_s

    def observe_draft_positions(self, drafts: dict[str, list[int]], num_accepted: dict[str, int]) -> None:
        """Count, per draft position, the verify rows that reached it (every earlier draft accepted) and those
        that accepted it: ``spec_acceptance_by_position`` (the conditional acceptance of each position)."""
        for rid, draft in drafts.items():
            accepted = num_accepted.get(rid, 0)
            for i in range(min(len(draft), accepted + 1)):
                if i == len(self.spec_positions):
                    self.spec_positions.append([0, 0])
                self.spec_positions[i][0] += 1
                self.spec_positions[i][1] += i < accepted

    def observe_finished(self, output: RequestOutput) -> None:
        """Add one finished request; aborted/rejected ones only count in ``num_failed``."""
        self._touch(self.clock.now())
        reason = output.outputs[0].finish_reason if output.outputs else None
        if output.error is None and reason in ("stop", "length") and output.metrics is not None:
            m = output.metrics
            self.completed.append(m)
            t = self._totals
            t["num_requests"] += 1
            t["total_input_tokens"] += m.num_prompt_tokens
            t["total_output_tokens"] += m.num_output_tokens
            t["total_cached_tokens"] += m.num_cached_tokens
            t["sum_kv_bytes"] += m.kv_bytes
            t["max_kv_bytes_per_request"] = max(t["max_kv_bytes_per_request"], m.kv_bytes)
            t["max_peak_kv_bytes_per_request"] = max(t["max_peak_kv_bytes_per_request"], m.peak_kv_bytes)
            t["num_meeting_slo"] += self._meets_slo(m)
        else:
            self.num_failed += 1

    def _meets_slo(self, m: RequestMetrics) -> bool:
        if self.slo_ttft_ms is not None and (m.ttft_s is None or m.ttft_s * 1000.0 > self.slo_ttft_ms):
            return False
        return self.slo_tpot_ms is None or m.tpot_s is None or m.tpot_s * 1000.0 <= self.slo_tpot_ms

    def summary(self, duration_s: float | None = None) -> dict[str, Any]:
        """Reduce everything observed so far.

        Args:
            duration_s: wall time the throughputs divide by, seconds; default from the start of
                the first observed step to the last observation.

        Returns:
            Flat dict: counts, ``duration_s``, ``request_throughput`` (req/s), ``request_goodput``
            (req/s; ``None`` without SLOs), ``output_throughput`` and ``total_token_throughput``
            (tok/s), ``{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el,queue}_ms``,
            ``{mean,max}_kv_bytes_per_request`` (KV each completed request held at its last step, bytes),
            ``max_peak_kv_bytes_per_request`` (the most it held at once, e.g. during a prefill chunk),
            ``peak_kv_cache_usage``, ``mean_kv_cache_usage``, ``mean_kv_cache_fragmentation``,
            ``peak_num_running_reqs`` / ``mean_num_running_reqs`` (concurrency),
            ``prefix_cache_hit_rate``, ``external_prefix_cache_queries`` / ``external_prefix_cache_hits`` (a KV
            connector's, tokens; 0 without one), a KV connector's transfers (``num_kv_transfers``,
            ``kv_transfer_bytes`` total bytes, ``kv_transfer_s`` summed seconds, ``kv_transfer_gb_per_s`` =
            bytes / seconds / 1e9, ``{mean,median,std,p90,p99}_kv_transfer_ms`` and ``mean_kv_transfer_bytes`` per
            transfer; counterparts of ``servelab:kv_transfer_seconds`` / ``servelab:kv_transfer_bytes``), ``num_preemptions``, ``num_steps``,
            ``dtype`` (the model's, resolved) and ``dtype_reason`` (why: ``framework.platform.choose_dtype``),
            ``kv_cache_dtype``, ``kv_cache_num_blocks``, ``kv_cache_bytes_per_block`` (bytes, the
            ``kv_cache_layers_per_block`` layers of a block), ``kv_cache_num_groups``, ``kv_cache_group_windows``,
            ``compile_mode`` (auto|true|false) and ``compile_reason`` (the decision, see
            ``framework.compilation.policy``), and once the decoder was compiled ``compile``,
            ``compile_active``, ``compile_s`` (warm-up seconds), ``compile_num_graphs_warmup``,
            ``compile_num_recompiles`` (graphs compiled after the warm-up), ``compile_fallback``, ``compile_layer_stack`` (see
            ``framework.compilation.decoder.CompileStats``), the executor's ``run_labels`` (``simulated``,
            ``sim_profile``: every run has them, a simulated one says where its step times came from),
            step-time totals ``<part>_s`` and fractions ``<part>_frac`` of total step time,
            ``tokens_per_forward`` (output tokens per request per target forward) and, when a
            drafter verified drafts, ``spec_acceptance_rate``, ``spec_mean_accepted_length`` (tokens
            per verify step incl. the target's own), ``spec_num_{draft,accepted}_tokens``,
            ``spec_draft_s``, ``spec_verify_s`` (forward + sample time of verifying steps) and
            ``spec_acceptance_by_position`` (a list: per draft position, accepted / verified with every earlier
            draft accepted; ``executor.params.acceptance`` of a simulated run can read it from this file), and with
            expert parallelism ``expert_load`` (per MoE layer, per expert tokens routed since the model loaded).
        """
        if duration_s is None:
            duration_s = 0.0 if self._first_s is None else self._last_s - self._first_s
        done, t = self.completed, self._totals  # latencies from the kept window; counts and totals exact
        n, n_in, n_out = t["num_requests"], t["total_input_tokens"], t["total_output_tokens"]

        def per_s(x: float) -> float:
            return x / duration_s if duration_s > 0 else 0.0

        has_slo = self.slo_ttft_ms is not None or self.slo_tpot_ms is not None
        out: dict[str, Any] = {
            "num_requests": n, "num_failed": self.num_failed, "duration_s": duration_s,
            "total_input_tokens": n_in, "total_output_tokens": n_out,
            "total_cached_tokens": t["total_cached_tokens"],
            "request_throughput": per_s(n),
            "request_goodput": per_s(t["num_meeting_slo"]) if has_slo else None,
            "output_throughput": per_s(n_out), "total_token_throughput": per_s(n_in + n_out),
            "mean_kv_bytes_per_request": t["sum_kv_bytes"] / n if n else 0.0,
            "max_kv_bytes_per_request": t["max_kv_bytes_per_request"],
            "max_peak_kv_bytes_per_request": t["max_peak_kv_bytes_per_request"],
        }
        series = {"ttft": [m.ttft_s for m in done], "tpot": [m.tpot_s for m in done],
                  "itl": [x for m in done for x in m.itl_s], "e2el": [m.e2e_s for m in done],
                  "queue": [m.queue_s for m in done]}
        for name, values in series.items():
            for stat, value in _describe([v for v in values if v is not None]).items():
                out[f"{stat}_{name}_ms"] = value
        total_step_s = self.step_time_s["step"] or sum(self.step_time_s[p] for p in STEP_PARTS)
        steps = max(self.num_steps, 1)
        out.update(peak_kv_cache_usage=self.peak_kv_cache_usage, mean_kv_cache_usage=self.sum_kv_cache_usage / steps,
                   mean_kv_cache_fragmentation=self.sum_kv_cache_fragmentation / steps,
                   peak_num_running_reqs=self.peak_num_running_reqs,
                   mean_num_running_reqs=self.sum_num_running_reqs / steps,
                   prefix_cache_hit_rate=self.prefix_cache_hit_rate,
                   num_preemptions=self.num_preemptions,
                   num_preemptions_recompute=self.num_preemptions - self.swap_totals["num_preemptions_swap"],
                   **self.swap_totals, num_steps=self.num_steps, step_s=total_step_s,
                   **self.kv_cache_info)
        out.update(self.external_prefix_cache)
        out.update(self._kv_transfer_summary())
        out.update(self.model_info)
        out.update(self.compile_info)
        out.update(self.run_labels)
        if self.compile_stats is not None and self.compile_stats.enabled:
            out.update(self.compile_stats.as_dict())
        if self.expert_load is not None:
            out.update(self.expert_load.as_dict())
        for part in STEP_PARTS:
            out[f"{part}_s"] = self.step_time_s[part]
            out[f"{part}_frac"] = self.step_time_s[part] / total_step_s if total_step_s > 0 else 0.0
        # output tokens per request per target forward: 1 without speculation, up to k+1 with it
        out["tokens_per_forward"] = (self.num_generated_tokens / self.num_sampled_reqs
                                     if self.num_sampled_reqs else 0.0)
        if self.spec["num_draft_tokens"]:
            out.update(self._spec_summary())
        return out

    def _spec_summary(self) -> dict[str, float | int]:
        """Speculative decoding: acceptance rate (accepted / drafted), mean accepted length per
        verify step (accepted drafts + the target's own token, so 1..k+1), drafter vs verify time."""
        s = self.spec
        return {"spec_num_draft_tokens": s["num_draft_tokens"], "spec_num_accepted_tokens": s["num_accepted_tokens"],
                "spec_acceptance_rate": s["num_accepted_tokens"] / s["num_draft_tokens"],
                "spec_mean_accepted_length": (s["num_accepted_tokens"] + s["num_spec_reqs"]) / s["num_spec_reqs"],
                "spec_draft_s": s["draft_s"], "spec_verify_s": self.spec_verify_s,
                "spec_acceptance_by_position": [accepted / reached for reached, accepted in self.spec_positions]}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1 else f"{value:.{digits}f}"
    return str(value)


def render_summary_table(summary: dict[str, Any]) -> Table:
    """A rich table of :meth:`MetricsCollector.summary`: one row per scalar (extra keys such as the
    runner's ``num_rejected`` included, in dict order), step-time parts as ``seconds (share %)``,
    then one row per latency with mean / median / p90 / p99 in ms (``std`` stays in ``metrics.json``)."""
    table = Table(title="servelab run summary", header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    latency_keys = {f"{stat}_{name}_ms" for stat in STATS for name in LATENCIES}
    frac_keys = {f"{part}_frac" for part in STEP_PARTS}
    for key, value in summary.items():
        if key in latency_keys or key in frac_keys:
            continue
        part = key.removesuffix("_s")
        if part in STEP_PARTS and f"{part}_frac" in summary:
            table.add_row(key, f"{_fmt(value)} ({100 * summary[f'{part}_frac']:.1f}%)")
        else:
            table.add_row(key, _fmt(value))
    table.add_section()
    for name in LATENCIES:
        values = [summary.get(f"{stat}_{name}_ms") for stat in ("mean", "median", "p90", "p99")]
        table.add_row(f"{name} ms mean/p50/p90/p99", " / ".join(_fmt(v, digits=1) for v in values))
    return table


def kv_transfer_summary(collectors: Sequence[MetricsCollector]) -> dict[str, Any]:
    """The KV transfer keys of :meth:`MetricsCollector.summary` over several collectors' transfers together (one
    engine's, or a data-parallel front's replicas'): ``num_kv_transfers``, ``kv_transfer_bytes`` (bytes) and
    ``kv_transfer_s`` (seconds) summed, ``kv_transfer_gb_per_s`` (bytes / seconds / 1e9; ``None`` without a transfer),
    ``{mean,median,std,p90,p99}_kv_transfer_ms`` and ``mean_kv_transfer_bytes`` per transfer (over the kept
    windows)."""
    totals = {key: sum(c.kv_transfer_totals[key] for c in collectors) for key in collectors[0].kv_transfer_totals}
    out: dict[str, Any] = dict(totals)
    seconds, size = totals["kv_transfer_s"], totals["kv_transfer_bytes"]
    out["kv_transfer_gb_per_s"] = size / seconds / 1e9 if seconds else None
    transfers = [t for c in collectors for t in c.kv_transfers]
    out.update({f"{stat}_kv_transfer_ms": value for stat, value in _describe([s for _, s in transfers]).items()})
    out["mean_kv_transfer_bytes"] = sum(b for b, _ in transfers) / len(transfers) if transfers else None
    return out
