"""The engine's clock: where every timestamp of a run comes from (arrivals, scheduling, tokens, finishes).

A run reads time through one :class:`Clock`, owned by its executor (``Executor.clock``) and shared by the
engine, the scheduler (and through it the policy), the metrics collector and the offline runner. Executors
that run a model keep the :data:`WALL_CLOCK`; a simulator (``executor=sim``) may hand out a
:class:`VirtualClock` that moves only when it says a step took time, so TTFT, TPOT, ITL, e2e latency,
queueing and throughput of 10,000 simulated requests come out in seconds of wall time, computed by the
very same code as a real run's.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod


class Clock(ABC):
    """A time source in seconds on one axis (only differences between its readings mean anything).

    Attributes:
        realtime: class attribute; True when readings follow wall time (a server needs it: clients
            wait in wall time).
    """

    realtime: bool = True

    @abstractmethod
    def now(self) -> float:
        """The current time, seconds."""

    @abstractmethod
    def sleep_until(self, t_s: float) -> None:
        """Idle until ``now() >= t_s`` (the offline runner waiting for the next arrival); returns at
        once when that time has passed."""


class WallClock(Clock):
    """``time.perf_counter`` (monotonic, sub-microsecond); idling really sleeps."""

    realtime = True

    def now(self) -> float:
        """``time.perf_counter()``, seconds."""
        return time.perf_counter()

    def sleep_until(self, t_s: float) -> None:
        """``time.sleep`` for what remains until ``t_s``."""
        time.sleep(max(0.0, t_s - time.perf_counter()))


class VirtualClock(Clock):
    """Simulated time: starts at ``start_s`` and moves only through :meth:`advance` (a simulated step's
    predicted duration) and :meth:`sleep_until` (jumping over idle time), never by itself.

    Args:
        start_s: the first reading, seconds.
    """

    realtime = False

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def now(self) -> float:
        """The simulated time, seconds."""
        return self._now_s

    def advance(self, duration_s: float) -> None:
        """Move time forward by ``duration_s`` seconds (a step that took that long).

        Raises:
            ValueError: a negative or non-finite duration.
        """
        if not 0.0 <= duration_s < float("inf"):
            raise ValueError(f"a virtual clock advances by a finite duration >= 0 s, got {duration_s}")
        self._now_s += duration_s

    def sleep_until(self, t_s: float) -> None:
        """Jump to ``t_s`` when it lies ahead (idle time costs no wall time)."""
        self._now_s = max(self._now_s, float(t_s))


#: the clock of every executor that runs a model
WALL_CLOCK = WallClock()
