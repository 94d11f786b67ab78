"""``engine.compile=auto|true|false``: whether the decoder is compiled, and why.

``true`` compiles at start-up and ``false`` never does. ``auto`` (the default) compiles where it pays, as
vLLM compiles by default, by a rule with numbers a user can check:

* a server (``servelab serve``, ``mode=serve``) compiles at start-up: its work is open-ended;
* offline work compiles, once, before the first batch of requests (an ``LLM.generate`` call, a
  ``run.py`` workload) whose expected saving exceeds the compile's expected warm-up:

  - the warm-up, seconds (:class:`CompileCosts`): measured on this machine for this model the last time
    it compiled (cold, or from inductor's on-disk cache when that cache is still there), else the prior
    :data:`PRIOR_WARM_UP_S`;
  - the saving, seconds: the decode steps the work needs (output tokens -- those the engine generated
    so far plus the batch's ``max_tokens`` budget, the past as a guess of the future -- over the batch
    size, ``min(requests, max_num_seqs)``) times the step time compiling saves at that batch size:
    eager and compiled decode steps measured on this machine at batch 1 and 64 and interpolated
    linearly (an eager measurement takes well under a second at the first decision; a compiled one
    needs a compile, so until then compiled steps take :data:`PRIOR_COMPILED_OVER_EAGER` of eager).

  The measurements are kept per machine and model (``framework/engine/compile_calibration.py``).

The decision and its reason (both numbers and where they came from) are logged when it is made and
reported in ``metrics.json`` (``compile_mode``, ``compile_reason``, ``compile_estimate``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The compile warm-up assumed before this machine has compiled the model, seconds: SmolLM2-135M bf16
#: on a 2-core AMD EPYC (docs/results.md, 2026-11-27): ~35 s cold (inductor's C++ toolchain probes,
#: the paged attention kernel and three layer graphs), ~5 s from inductor's on-disk cache.
PRIOR_WARM_UP_S = {"cold": 40.0, "cached": 6.0}
#: Compiled over eager decode step time assumed until a compiled step is measured, by batch size
#: (same machine and model: 14.8 vs 29.3 ms at batch 1, 2.1 vs 2.8 ms per token at batch 64).
PRIOR_COMPILED_OVER_EAGER = {1: 0.5, 64: 0.75}
#: Batch sizes at which decode steps are measured (and between which they are interpolated).
CALIBRATION_BATCH_SIZES = (1, 64)


@dataclass
class CompileCosts:
    """What compiling costs and saves here (measured, or the priors above), in the units of the rule."""

    warm_up_s: float  # expected compile warm-up, seconds
    warm_up_source: str  # where warm_up_s comes from ("measured here, from inductor's cache", "prior"...)
    eager_step_ms: dict[int, float] = field(default_factory=dict)  # batch size -> eager decode step, ms
    compiled_step_ms: dict[int, float] = field(default_factory=dict)  # batch size -> compiled decode step, ms
    step_source: str = "prior"  # where the step times come from

    def step_ms(self, batch: int, compiled: bool) -> float | None:
        """Decode step time at ``batch`` rows, ms: linear through the measured batch sizes (the two
        nearest; extrapolated past the ends); compiled falls back to eager x
        :data:`PRIOR_COMPILED_OVER_EAGER`; ``None`` without any eager measurement."""
        table = self.compiled_step_ms if compiled and self.compiled_step_ms else self.eager_step_ms
        if not table:
            return None
        value = _interpolate(table, batch)
        if compiled and not self.compiled_step_ms:
            value *= _interpolate(PRIOR_COMPILED_OVER_EAGER, batch)
        return value


def _interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear value of ``table`` at ``x`` (constant for one point)."""
    points = sorted(table.items())
    if len(points) == 1:
        return points[0][1]
    lo, hi = (points[0], points[1]) if x <= points[0][0] else (points[-2], points[-1])
    for a, b in zip(points, points[1:]):
        if a[0] <= x <= b[0]:
            lo, hi = a, b
    return lo[1] + (hi[1] - lo[1]) * (x - lo[0]) / (hi[0] - lo[0])


@dataclass(frozen=True)
class CompileDecision:
    """Whether to compile now, and the reason a user reads in the log and ``metrics.json``."""

    compile: bool  # compile the decoder before the next batch of work
    reason: str  # one sentence: the mode, the rule that applied and how to override it
    estimate: dict[str, Any] | None = None  # auto: the rule's numbers (warm-up and saving, s; batch; sources)


def decide_compile(mode: str, planned_output_tokens: int | None, planned_requests: int = 1,
                   costs: CompileCosts | None = None, max_num_seqs: int = 256,
                   generated_tokens: int = 0) -> CompileDecision:
    """Apply the rule of the module docstring.

    Args:
        mode: ``EngineConfig.compile``: ``auto``, ``true`` or ``false``.
        planned_output_tokens: the ``max_tokens`` budget of the work about to start, tokens; ``None``
            for open-ended work (a server).
        planned_requests: requests in that work (the batch size is ``min(requests, max_num_seqs)``).
        costs: this machine's numbers (:class:`CompileCosts`); ``None`` or without an eager step
            measurement: stay eager (nothing to estimate a saving from).
        max_num_seqs: the engine's cap on requests per step.
        generated_tokens: output tokens the engine generated before, tokens.

    Returns:
        The decision; ``mode="true"``/``"false"`` always compile / never do.
    """
    if mode == "true":
        return CompileDecision(True, "engine.compile=true: compiled at start-up")
    if mode == "false":
        return CompileDecision(False, "engine.compile=false: eager")
    if planned_output_tokens is None:
        return CompileDecision(True, "engine.compile=auto: compiling, a server's work is open-ended "
                                     "(engine.compile=false starts faster)")
    batch = max(1, min(planned_requests, max_num_seqs))
    tokens = generated_tokens + planned_output_tokens
    eager = costs.step_ms(batch, compiled=False) if costs is not None else None
    if eager is None:
        return CompileDecision(False, "engine.compile=auto: eager, no decode step time measured to estimate "
                                      "a saving from (engine.compile=true forces it)")
    compiled = costs.step_ms(batch, compiled=True)
    saving_s = tokens / batch * (eager - compiled) / 1e3
    estimate = {"warm_up_s": round(costs.warm_up_s, 2), "warm_up_source": costs.warm_up_source,
                "saving_s": round(saving_s, 2), "output_tokens": tokens, "batch": batch,
                "eager_step_ms": round(eager, 2), "compiled_step_ms": round(compiled, 2),
                "step_source": costs.step_source}
    numbers = (f"~{costs.warm_up_s:.1f} s warm-up ({costs.warm_up_source}) vs ~{saving_s:.1f} s saved on "
               f"{tokens:,} output tokens (generated + planned) at batch {batch} (decode step {eager:.1f} -> "
               f"{compiled:.1f} ms, {costs.step_source})")
    if saving_s > costs.warm_up_s:
        return CompileDecision(True, f"engine.compile=auto: compiling, {numbers} (engine.compile=false skips it)",
                               estimate)
    return CompileDecision(False, f"engine.compile=auto: eager, {numbers} (engine.compile=true forces it)", estimate)


def startup_reason(mode: str, compiled: bool = True) -> str:
    """What an engine built with ``engine.compile=<mode>`` does about compilation (logged at start-up);
    ``compiled``: whether the ranks compiled while the engine was built (``true`` defers it for a
    server, which compiles while it answers ``/health``)."""
    if mode == "true":
        return ("engine.compile=true: the decoder was compiled at start-up" if compiled
                else "engine.compile=true: the decoder compiles before the first request")
    if mode == "false":
        return "engine.compile=false: the decoder runs eagerly"
    return ("engine.compile=auto: eager for now; compiles at the start of a server, or before offline work whose "
            "expected saving exceeds the compile's warm-up on this machine (engine.compile=true|false forces it)")
