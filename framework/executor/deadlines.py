"""How long a multi-process executor waits for its ranks before it declares one lost (issue 44).

Three signals, each with its own bound, so no failure waits on a flat 120 s:

- **Exit** (a process sentinel; Ray: the actor's death): seen at once.
- **Heartbeat**: every rank process beats from a thread of its own (``mp``: a timestamp in the
  broadcast ring's segment every :data:`~framework.worker.worker_proc.HEARTBEAT_INTERVAL_S`; ``ray``: an answer to a ping on a
  concurrency group of its own). A rank silent for ``heartbeat_timeout_s`` is stopped (SIGSTOP, a
  debugger) or stuck holding the GIL: lost, whatever call is in flight, idle included.
- **Call deadline** (a rank that beats but does not answer: a deadlock that releases the GIL, a
  plugin that sleeps): ``execute_model`` gets a *step deadline* from the step times measured so far
  (:class:`StepDeadline`), the compile warm-up (``compile_decoder``, and ``initialize_cache`` with
  ``engine.compile=true``) ``compile_timeout_s``, start-up (weights) ``startup_timeout_s``, every
  other call ``rpc_timeout_s``.

The executor that declares a rank lost kills every rank at once (their collectives would otherwise
wait for the lost one); the worker-side timeouts (``torch.distributed``'s, the shared-memory
communicator's) are only a backstop for a driver that cannot (see ``framework.worker.worker``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import Any

#: steps of fewer tokens are extrapolated as if they had this many (their time is mostly fixed cost)
MIN_EXTRAPOLATION_TOKENS = 16
#: calls that run the compile warm-up (``initialize_cache`` does when ``engine.compile=true``)
COMPILE_CALLS = ("compile_decoder",)


@dataclass(frozen=True)
class Deadlines:
    """The executor's bounds, seconds (``executor.params`` of ``mp`` and ``ray``).

    Attributes:
        startup_timeout_s: process start to "weights loaded" of every rank.
        rpc_timeout_s: any call but ``execute_model`` and the compile warm-up.
        compile_timeout_s: a compile warm-up (cold ``torch.compile`` of SmolLM2's layer graphs: ~20-30 s
            on 2 cores, docs/results/reliability.md; a large model or a slow machine takes many times that).
        execute_timeout_s: the step deadline's ceiling, and the deadline before any step was measured.
        min_step_deadline_s: the step deadline's floor (absorbs scheduling noise on a shared machine).
        step_deadline_factor: the step deadline is this many times the step's expected time.
        heartbeat_timeout_s: a rank without a heartbeat this long is lost.
    """

    startup_timeout_s: float = 600.0
    rpc_timeout_s: float = 120.0
    compile_timeout_s: float = 1800.0
    execute_timeout_s: float = 300.0
    min_step_deadline_s: float = 30.0
    step_deadline_factor: float = 8.0
    heartbeat_timeout_s: float = 10.0

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> tuple[Deadlines, dict[str, Any]]:
        """Split ``params`` into the deadlines and the rest.

        Raises:
            ValueError: a bound that is not a positive number (names it).
        """
        names = {f.name for f in fields(cls)}
        mine = {k: v for k, v in params.items() if k in names}
        for key, value in mine.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"executor.params.{key} must be a positive number of seconds, got {value!r}")
        return cls(**{k: float(v) for k, v in mine.items()}), {k: v for k, v in params.items() if k not in names}

    def for_call(self, method: Any, compile_at_start: bool) -> float:
        """The deadline of one ``collective_rpc`` of ``method`` (a name or a callable) other than ``execute_model``."""
        if method in COMPILE_CALLS or (method == "initialize_cache" and compile_at_start):
            return self.compile_timeout_s
        return self.rpc_timeout_s


class StepDeadline:
    """The deadline of one ``execute_model`` from the step times measured so far.

    Expected time of a step of ``n`` tokens: the largest over the last ``window`` steps of each step's
    time scaled up (never down) by ``n / max(its tokens, MIN_EXTRAPOLATION_TOKENS)``, i.e. a linear
    extrapolation from every recent step, which over-estimates (per-token cost falls with batch size)
    but never under-estimates by more than a step's noise. A step of fewer tokens than
    :data:`MIN_EXTRAPOLATION_TOKENS` is mostly fixed cost (the call, collectives, sampling), so it is
    extrapolated as if it had that many: a 300 ms decode step (a scheduling hiccup on a shared machine)
    would otherwise make a 35-token prefill's deadline 84 s. Deadline: ``factor x expected``, clamped to ``[min_step_deadline_s,
    execute_timeout_s]``; until a step is measured, ``execute_timeout_s``. The executor's first step is
    not measured: it pays one-off initialisation (oneDNN primitives, first allocations; 1.5 s for a
    5-token stories260K prefill on a Ray actor, against ~10 ms for the steps after it), which the
    extrapolation would carry to every later step. Extrapolating a decode step's time to a long prefill
    over-estimates (per-token cost falls with batch size); the ceiling bounds that.

    Args:
        deadlines: the executor's bounds.
        window: steps remembered.
    """

    def __init__(self, deadlines: Deadlines, window: int = 256) -> None:
        self.deadlines = deadlines
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._skipped_first = False

    def deadline_s(self, num_tokens: int) -> float:
        """Seconds the step of ``num_tokens`` scheduled tokens may take."""
        d = self.deadlines
        if not self._steps:
            return d.execute_timeout_s
        n = max(num_tokens, 1)
        expected = max(seconds * max(1.0, n / max(tokens, MIN_EXTRAPOLATION_TOKENS)) for tokens, seconds in self._steps)
        return min(max(d.step_deadline_factor * expected, d.min_step_deadline_s), d.execute_timeout_s)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """Record a completed step (wall time of the call, seconds); the first one is not kept (see the class)."""
        if not self._skipped_first:
            self._skipped_first = True
            return
        self._steps.append((max(num_tokens, 1), seconds))
