"""``engine.compile=auto|true|false``: whether the decoder is compiled, and why.

``true`` compiles at start-up and ``false`` never does. ``auto`` (the default) compiles where it pays, as
vLLM compiles by default, with a rule a user can predict:

* a server (``servelab serve``, ``mode=serve``) compiles at start-up: its work is open-ended;
* offline work compiles, once, before the first batch of requests (an ``LLM.generate`` call, a
  ``run.py`` workload) that brings the engine's output tokens -- those it already generated plus the
  batch's ``max_tokens`` budget -- to :data:`COMPILE_BREAK_EVEN_TOKENS`; below that the run stays
  eager, because the compile's warm-up would cost more than it saves.

The decision and its reason are logged when it is made and reported in ``metrics.json``
(``compile_mode``, ``compile_reason``).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Output tokens past which ``engine.compile=auto`` compiles: the compile's one-off warm-up over the
#: time compiling saves per generated token. From docs/results.md (AMD EPYC Zen 4, 2 cores, SmolLM2-135M
#: bf16): the warm-up took 40-57 s (three graphs, every pass since the sixth; 68.5 s cold in the second
#: pass), and eager vs compiled ran 400.1 vs 530.8 output tok/s on 64 prompts x 128 tokens in one run
#: (seventh pass): 2.50 vs 1.88 ms per token, 0.62 ms saved, so ~45 s / 0.62 ms = ~73,000 tokens. At
#: batch 1 (32.6 vs 15.2 ms/token) the same warm-up pays after ~2,600 tokens: the rule takes the
#: batch-64 figure, so long runs of small batches compile late (``engine.compile=true`` forces it).
#: Re-measured 2026-11-25 with ``experiments/compile_break_even.py`` (same machine kind, after the model-
#: family, KV-group and executor merges): warm-up 44.4 s from inductor's on-disk cache but 394 s cold (a
#: fresh cache), eager vs compiled 2.79 vs 2.11 ms/token at batch 64 (0.68 ms saved) and 33.9 vs 16.5 at
#: batch 1: break-even 65,500 tokens cached / 583,000 cold at batch 64, 2,600 / 22,700 at batch 1. The
#: constant stays the cached batch-64 figure: the cold compile is paid once per machine and model.
COMPILE_BREAK_EVEN_TOKENS = 70_000


@dataclass(frozen=True)
class CompileDecision:
    """Whether to compile now, and the reason a user reads in the log and ``metrics.json``."""

    compile: bool  # compile the decoder before the next batch of work
    reason: str  # one sentence: the mode, the rule that applied and how to override it


def decide_compile(mode: str, planned_output_tokens: int | None, generated_tokens: int = 0,
                   break_even_tokens: int | None = None) -> CompileDecision:
    """Apply the rule of the module docstring.

    Args:
        mode: ``EngineConfig.compile``: ``auto``, ``true`` or ``false``.
        planned_output_tokens: the ``max_tokens`` budget of the work about to start, tokens; ``None``
            for open-ended work (a server).
        generated_tokens: output tokens the engine generated before, tokens.
        break_even_tokens: the threshold, tokens; default :data:`COMPILE_BREAK_EVEN_TOKENS` (read at
            call time, so a test or a study can patch it).

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
    threshold = COMPILE_BREAK_EVEN_TOKENS if break_even_tokens is None else break_even_tokens
    total = generated_tokens + planned_output_tokens
    if total >= threshold:
        return CompileDecision(True, f"engine.compile=auto: compiling, {total:,} output tokens (generated + "
                                     f"planned) reach the break-even of {threshold:,} (engine.compile=false skips it)")
    return CompileDecision(False, f"engine.compile=auto: eager, {total:,} output tokens (generated + planned) are "
                                  f"below the break-even of {threshold:,}, where the compile's warm-up would cost "
                                  "more than it saves (engine.compile=true forces it)")


def startup_reason(mode: str) -> str:
    """What an engine built with ``engine.compile=<mode>`` does about compilation (logged at start-up)."""
    if mode == "true":
        return "engine.compile=true: the decoder was compiled at start-up"
    if mode == "false":
        return "engine.compile=false: the decoder runs eagerly"
    return ("engine.compile=auto: eager for now; compiles at the start of a server, or before the offline work "
            f"that brings the output tokens to the break-even of {COMPILE_BREAK_EVEN_TOKENS:,} "
            "(engine.compile=true|false forces it)")
