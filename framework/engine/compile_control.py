"""When one engine compiles its decoder (``engine.compile``), and what it reports about it.

The rule is :mod:`framework.compilation.policy` with this machine's numbers (:mod:`framework.compilation.calibration`);
this is the engine's side of it: the decision in force, the decode steps run eagerly so far (``auto``'s past
saving), the real all-decode step times the calibration learns from, the compile itself on every rank and its
mirror in the metrics (``compile_mode``, ``compile_reason``, ``compile_estimate``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from framework.compilation.calibration import CompilePlanner
from framework.compilation.policy import CompileDecision, startup_reason
from framework.config import EngineConfig
from framework.core.outputs import SchedulerStats
from framework.core.scheduler import Scheduler
from framework.interfaces import Executor
from framework.metrics.collector import MetricsCollector

logger = logging.getLogger(__name__)


class CompileControl:
    """The compile state of one engine.

    Args:
        config: the engine's config (``engine.compile``).
        executor: runs ``compile_stats`` / ``compile_decoder`` / ``time_decode_steps`` on every rank.
        metrics: the engine's collector (``compile_info``; ``compile_stats`` read live; ``run_labels``).
        scheduler: the engine's scheduler (:meth:`_make_idle` drops its prefix cache).
    """

    def __init__(self, config: EngineConfig, executor: Executor, metrics: MetricsCollector,
                 scheduler: Scheduler) -> None:
        self.config, self.executor, self.metrics, self.scheduler = config, executor, metrics, scheduler
        stats = executor.collective_rpc("compile_stats", unique_reply_rank=0)[0]
        # the ranks compiled at start-up (engine.compile=true; a server's build defers it to maybe_compile)
        self.compiled = bool(stats.enabled)
        self.decision = CompileDecision(self.compiled, startup_reason(str(config.compile), self.compiled))
        self.planner = CompilePlanner(config, executor)  # engine.compile=auto's measured numbers
        if self.compiled:  # what the start-up compile cost is a measurement too
            self.planner.record_compile(stats)
        logger.info("%s", self.decision.reason)
        self._checked = False  # maybe_compile ran once (its first eager verdict is logged at INFO)
        self.eager_steps: Counter[int] = Counter()  # decode steps run eagerly so far, by batch size
        self._record()

    def maybe_compile(self, planned_budgets: Sequence[int] | None, repeats: int = 1) -> CompileDecision:
        """``engine.compile=auto``: compile the decoder now if the work about to start is expected to save
        more than the compile costs on this machine (``framework/compilation/policy.py``, numbers from
        ``framework/compilation/calibration.py``); engines built with ``true``/``false``, or compiled
        already, keep their decision.

        The saving counts the decode steps the budgets run (batch shrinking as requests finish,
        ``policy.decode_schedule``) plus the steps this engine ran eagerly so far. The warm-up (and the first
        decision's eager step measurement) writes dummy K/V, so the prefix cache is dropped first; while a
        request holds KV blocks the compile is put off to the next call (reason logged).

        Args:
            planned_budgets: output-token budget of each request of the work about to start, tokens
                (``policy.output_budget``; ``n`` samples count ``n`` times); ``None`` for open-ended work
                (a server).
            repeats: that work runs this many times in a row (a benchmark's repeats; a loop of ``generate``
                calls that cannot say so up front is caught by the steps run so far).

        Returns:
            The decision in force (also in ``metrics.json`` as ``compile_reason``, ``compile_estimate``).
        """
        self.planner.flush_observed()  # the real steps run so far count in this decision
        if self.config.compile == "false" or self.compiled:
            return self.decision
        if self.metrics.run_labels.get("simulated"):  # step times are the profile's, compiled or not
            self.decision = CompileDecision(False, "engine.compile=auto: the executor simulates the model; its "
                                                   "profile's step times hold")
            self._record()
            return self.decision
        if self.config.compile == "true":  # deferred by the build (a server compiles while answering /health)
            decision = CompileDecision(True, "engine.compile=true: compiled before the first request")
        else:  # measuring steps writes dummy K/V too: only on an engine made idle (prefix cache dropped)
            decision = self.planner.decide(planned_budgets, self.eager_steps, self._make_idle, repeats)
        if decision.compile and not self._make_idle():
            decision = CompileDecision(False, "engine.compile=auto: compile put off, requests still hold KV "
                                              "blocks (the warm-up writes dummy K/V)", decision.estimate)
        logger.log(logging.INFO if decision.compile or not self._checked else logging.DEBUG, "%s", decision.reason)
        self._checked = True
        self.decision = decision
        if decision.compile:
            self.executor.collective_rpc("compile_decoder")  # every rank: collectives stay in step under TP
            self.compiled = True
            self.planner.record_compile(self.metrics.compile_stats.current())
        self._record()
        return decision

    def _make_idle(self) -> bool:
        """Drop the prefix cache when no request holds a KV block; True if the engine is idle now (the dummy
        steps of a compile warm-up or a step measurement may then write blocks 0, 1, ...)."""
        return not self.scheduler.has_unfinished_requests() and self.scheduler.reset_prefix_cache()

    def observe_step(self, stats: SchedulerStats, execute_s: float, realtime: bool) -> None:
        """Note a step: its sampled requests count toward the eager steps (until compiled); a step of plain
        decodes only (no prefill chunk, draft or swap) on the wall clock (``realtime``) gives the calibration
        a real step time (``execute_s``: seconds in the executor, at batch ``stats.num_decode_tokens``)."""
        if stats.num_sampled_reqs and not self.compiled:
            self.eager_steps[stats.num_sampled_reqs] += 1
        plain = not (stats.num_prefill_tokens or stats.num_spec_reqs or stats.num_swap_out_blocks
                     or stats.num_swap_in_blocks)
        if plain and realtime and stats.num_decode_tokens:
            self.planner.observe_decode_step(stats.num_decode_tokens, execute_s, self.compiled)

    def _record(self) -> None:
        """Mirror the decision into the metrics."""
        self.metrics.compile_info = {"compile_mode": str(self.config.compile), "compile_reason": self.decision.reason,
                                     "compile_estimate": self.decision.estimate}


class RankZeroCompileStats:
    """Rank 0's :class:`~framework.compilation.decoder.CompileStats`, fetched afresh whenever the metrics
    read it (recompiles grow inside the worker; a worker process would otherwise leave the driver a
    stale copy). After the executor died, the last copy fetched."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._last = executor.collective_rpc("compile_stats", unique_reply_rank=0)[0]

    @property
    def enabled(self) -> bool:
        """The decoder was compiled (at start-up, or later by ``engine.compile=auto``)."""
        return self.current().enabled

    def current(self) -> Any:
        """Rank 0's ``CompileStats`` now (the last copy once the executor is shut down or lost)."""
        if self._executor.dead is None:
            with contextlib.suppress(RuntimeError):  # shut down or lost meanwhile: keep the last copy
                self._last = self._executor.collective_rpc("compile_stats", unique_reply_rank=0)[0]
        return self._last

    def as_dict(self) -> dict[str, Any]:
        """``CompileStats.as_dict`` of rank 0 now (``metrics.json`` keys)."""
        return self.current().as_dict()
