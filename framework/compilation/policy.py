"""``engine.compile=auto|true|false``: whether the decoder is compiled, and why.

``true`` compiles at start-up and ``false`` never does. ``auto`` (the default) compiles where it pays, as
vLLM compiles by default, by a rule with numbers a user can check:

* a server (``servelab serve``, ``mode=serve``) compiles at start-up: its work is open-ended;
* offline work compiles, once, before the first batch of requests (an ``LLM.generate`` call, a
  ``run.py`` workload) whose expected saving exceeds the compile's expected warm-up:

  - the warm-up, seconds (:class:`CompileCosts`): measured on this machine for this model the last time
    it compiled (cold, or from inductor's on-disk cache when that cache is still there), else the prior
    :data:`PRIOR_WARM_UP_S`;
  - the saving, seconds: the sum, over the decode steps the work runs, of the step time compiling saves
    at that step's batch size (:meth:`CompileCosts.step_saving_ms`), plus the same sum over the decode
    steps the engine already ran eagerly (the past as a guess of the future: a loop of small
    ``generate`` calls compiles once it has spent what compiling would have saved, the ski-rental
    rule). The work's steps come from its requests' output-token budgets (:func:`output_budget`) by
    :func:`decode_schedule`: every request admitted at once up to ``max_num_seqs``, each running its
    whole budget, the batch shrinking as requests finish (a mixed workload's tail runs at small batch,
    where compiling saves the most per token). Eager and compiled decode steps are measured on this
    machine at batch 1 and 64 (:data:`CALIBRATION_BATCH_SIZES`) and interpolated linearly (an eager
    measurement takes well under a second at the first decision; a compiled one needs a compile, so
    until then compiled steps take :data:`PRIOR_COMPILED_OVER_EAGER` of eager).

  The measurements are kept per machine and model (``framework/compilation/calibration.py``).

The decision and its reason (both numbers and where they came from) are logged when it is made and
reported in ``metrics.json`` (``compile_mode``, ``compile_reason``, ``compile_estimate``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The compile warm-up assumed before this machine has compiled the model, seconds: SmolLM2-135M bf16
#: on a 2-core AMD EPYC (docs/results/compile.md, 2026-11-27): ~35 s cold (inductor's C++ toolchain probes,
#: the paged attention kernel and three layer graphs), ~5 s from inductor's on-disk cache.
PRIOR_WARM_UP_S = {"cold": 40.0, "cached": 6.0}
#: Compiled over eager decode step time assumed until a compiled step is measured, by batch size
#: (same machine and model: 14.8 vs 29.3 ms at batch 1, 2.1 vs 2.8 ms per token at batch 64); held at
#: the end values outside [1, 64].
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
        nearest; extrapolated linearly past the ends: step times grow with the rows a step computes);
        compiled falls back to eager x :data:`PRIOR_COMPILED_OVER_EAGER` (the ratio held at its end values
        outside its batch sizes, never extrapolated); ``None`` without any eager measurement."""
        table = self.compiled_step_ms if compiled and self.compiled_step_ms else self.eager_step_ms
        if not table:
            return None
        value = interpolate(table, batch)
        if compiled and not self.compiled_step_ms:
            lo, hi = min(PRIOR_COMPILED_OVER_EAGER), max(PRIOR_COMPILED_OVER_EAGER)
            value *= interpolate(PRIOR_COMPILED_OVER_EAGER, min(max(batch, lo), hi))
        return value

    def step_saving_ms(self, batch: int) -> float | None:
        """Decode step time compiling saves at ``batch`` rows, ms: eager minus compiled
        (:meth:`step_ms`, both linear in the batch size through the calibrated points and extrapolated
        linearly past them), never below 0 (two noisy points extrapolated far must not make compiling
        cost time); ``None`` without any eager measurement."""
        eager = self.step_ms(batch, compiled=False)
        if eager is None:
            return None
        return max(0.0, eager - self.step_ms(batch, compiled=True))


def interpolate(table: Mapping[int, float], x: int) -> float:
    """Piecewise-linear value of ``table`` (batch size -> ms) at ``x``: through the two nearest points,
    extrapolated linearly past the ends (constant for one point)."""
    points = sorted(table.items())
    if len(points) == 1:
        return points[0][1]
    lo, hi = (points[0], points[1]) if x <= points[0][0] else (points[-2], points[-1])
    for a, b in zip(points, points[1:]):
        if a[0] <= x <= b[0]:
            lo, hi = a, b
    return lo[1] + (hi[1] - lo[1]) * (x - lo[0]) / (hi[0] - lo[0])


def output_budget(max_tokens: int | None, prompt: str | list[int] | None, max_model_len: int,
                  tokenize: Callable[[str], list[int]] | None = None) -> int:
    """A request's output-token budget, tokens: ``max_tokens`` capped by ``max_model_len`` minus the
    prompt's tokens (the whole cap when ``max_tokens`` is ``None``).

    Args:
        max_tokens: the request's ``SamplingParams.max_tokens``; ``None``: up to ``max_model_len``.
        prompt: token ids, or text (tokenized with ``tokenize`` only when ``max_tokens`` is ``None``:
            otherwise the cap rarely binds and the prompt is counted as empty), or ``None`` (unknown).
        max_model_len: the engine's prompt + output cap, tokens.
        tokenize: text -> token ids (``LLMEngine.tokenize``); a ``ValueError`` from it (the engine will
            refuse the request) makes the budget 0.

    Returns:
        The budget, >= 0.
    """
    num_prompt = 0
    if isinstance(prompt, list):
        num_prompt = len(prompt)
    elif isinstance(prompt, str) and max_tokens is None and tokenize is not None:
        try:
            num_prompt = len(tokenize(prompt))
        except ValueError:
            return 0
    cap = max(max_model_len - num_prompt, 0)
    return cap if max_tokens is None else min(max_tokens, cap)


def decode_schedule(budgets: Sequence[int], max_num_seqs: int) -> dict[int, int]:
    """The decode steps a batch of requests runs, by batch size, under a simple schedule: requests are
    admitted in order up to ``max_num_seqs`` at once, each runs one token per step for its whole budget,
    and a finished request's seat goes to the next waiting one (continuous batching, as vLLM's
    scheduler). With ``len(budgets) <= max_num_seqs`` step ``t`` (1..max budget) runs at batch
    ``#{i: budgets[i] >= t}``. It ignores the KV cache's limit, chunked prefill and early stops (EOS):
    real batches are no larger, and where they are smaller each token saves more.

    Args:
        budgets: output-token budget of each request, tokens (:func:`output_budget`); 0 runs no step.
        max_num_seqs: the engine's cap on requests per step.

    Returns:
        batch size -> decode steps at that size (steps sum to the schedule's length); ``{}`` for no work.
    """
    cap = max(1, max_num_seqs)
    waiting = iter(b for b in budgets if b > 0)
    running: list[int] = []  # heap of the step at which each running request finishes
    steps: dict[int, int] = {}
    now = 0
    while True:
        while len(running) < cap and (budget := next(waiting, None)) is not None:
            heapq.heappush(running, now + budget)
        if not running:
            return steps
        end = running[0]
        steps[len(running)] = steps.get(len(running), 0) + end - now
        now = end
        while running and running[0] == now:
            heapq.heappop(running)


@dataclass(frozen=True)
class CompileDecision:
    """Whether to compile now, and the reason a user reads in the log and ``metrics.json``."""

    compile: bool  # compile the decoder before the next batch of work
    reason: str  # one sentence: the mode, the rule that applied and how to override it
    estimate: dict[str, Any] | None = None  # auto: the rule's numbers (warm-up and saving, s; steps; sources)


def decide_compile(mode: str, planned_budgets: Sequence[int] | None, costs: CompileCosts | None = None,
                   max_num_seqs: int = 256, past_steps: Mapping[int, int] | None = None,
                   repeats: int = 1) -> CompileDecision:
    """Apply the rule of the module docstring.

    Args:
        mode: ``EngineConfig.compile``: ``auto``, ``true`` or ``false``.
        planned_budgets: the output-token budget of each request of the work about to start, tokens
            (:func:`output_budget`; a request with ``n`` samples counts ``n`` times); ``None`` for
            open-ended work (a server).
        costs: this machine's numbers (:class:`CompileCosts`); ``None`` or without an eager step
            measurement: stay eager (nothing to estimate a saving from).
        max_num_seqs: the engine's cap on requests per step.
        past_steps: batch size -> decode steps the engine ran eagerly before (``LLMEngine`` counts them).
        repeats: the planned work runs this many times in a row (a benchmark's repeats), >= 1.

    Returns:
        The decision; ``mode="true"``/``"false"`` always compile / never do.
    """
    if mode == "true":
        return CompileDecision(True, "engine.compile=true: compiled at start-up")
    if mode == "false":
        return CompileDecision(False, "engine.compile=false: eager")
    if planned_budgets is None:
        return CompileDecision(True, "engine.compile=auto: compiling, a server's work is open-ended "
                                     "(engine.compile=false starts faster)")
    if costs is None or costs.step_saving_ms(1) is None:
        return CompileDecision(False, "engine.compile=auto: eager, no decode step time measured to estimate "
                                      "a saving from (engine.compile=true forces it)")
    estimate = _estimate(planned_budgets, costs, max_num_seqs, past_steps or {}, max(1, repeats))
    numbers = _describe(estimate, costs)
    if estimate["saving_s"] > costs.warm_up_s:
        return CompileDecision(True, f"engine.compile=auto: compiling, {numbers} (engine.compile=false skips it)",
                               estimate)
    return CompileDecision(False, f"engine.compile=auto: eager, {numbers} (engine.compile=true forces it)", estimate)


def _saving_s(steps: Mapping[int, int], costs: CompileCosts) -> float:
    """Seconds compiling saves over ``steps`` (batch size -> decode steps)."""
    return sum(n * costs.step_saving_ms(batch) for batch, n in steps.items()) / 1e3


def _estimate(budgets: Sequence[int], costs: CompileCosts, max_num_seqs: int, past_steps: Mapping[int, int],
              repeats: int) -> dict[str, Any]:
    """The rule's numbers (``CompileDecision.estimate``, JSON-ready): warm-up and saving (s), the planned
    decode steps and their first and last batch sizes, the past steps' share, the step times at those
    batch sizes (ms) and where every number came from."""
    steps = {batch: n * repeats for batch, n in decode_schedule(budgets, max_num_seqs).items()}
    planned_s, past_s = _saving_s(steps, costs), _saving_s(past_steps, costs)
    first, last = (max(steps), min(steps)) if steps else (0, 0)
    step_ms = {str(b): {"eager": round(costs.step_ms(b, compiled=False), 2),
                        "compiled": round(costs.step_ms(b, compiled=True), 2)} for b in sorted({first, last} - {0})}
    return {"warm_up_s": round(costs.warm_up_s, 2), "warm_up_source": costs.warm_up_source,
            "saving_s": round(planned_s + past_s, 2), "planned_saving_s": round(planned_s, 2),
            "decode_steps": sum(steps.values()), "batch_first": first, "batch_last": last,
            "requests": sum(1 for b in budgets if b > 0), "output_tokens": sum(budgets), "repeats": repeats,
            "past_decode_steps": sum(past_steps.values()), "past_saving_s": round(past_s, 2),
            "step_ms": step_ms, "step_source": costs.step_source}


def _describe(estimate: dict[str, Any], costs: CompileCosts) -> str:
    """The estimate in the words of the log line."""
    steps = ", ".join(f"{t['eager']:.1f} -> {t['compiled']:.1f} ms at batch {b}"
                      for b, t in sorted(estimate["step_ms"].items(), key=lambda kv: -int(kv[0])))
    runs = f" x {estimate['repeats']} runs" if estimate["repeats"] > 1 else ""
    whose = "request's" if estimate["requests"] == 1 else "requests'"
    planned = (f"{estimate['decode_steps']:,} decode steps (batch {estimate['batch_first']}→{estimate['batch_last']}) "
               f"of {estimate['requests']:,} {whose} {estimate['output_tokens']:,}-token budget{runs}")
    saved = f"~{estimate['saving_s']:.1f} s saved over {planned}"
    if estimate["past_decode_steps"]:
        saved = (f"~{estimate['saving_s']:.1f} s saved, ~{estimate['planned_saving_s']:.1f} s over {planned} and "
                 f"~{estimate['past_saving_s']:.1f} s over the {estimate['past_decode_steps']:,} decode steps run "
                 "eagerly so far")
    return (f"~{costs.warm_up_s:.1f} s warm-up ({costs.warm_up_source}) vs {saved} "
            f"(decode step {steps or 'not run'}; {costs.step_source})")


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
