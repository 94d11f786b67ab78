"""A watchdog for engine steps that never end (issue 44; SGLang's ``watchdog_timeout``).

A plugin hook or a forward that hangs leaves the engine loop waiting forever, and the executor's
deadlines cannot see it when it hangs on the driver. :class:`StepWatchdog` is one daemon thread per
engine front end (``LLM``, ``AsyncLLM``) that looks every :data:`TICK_S` at the step in progress; a step
running past ``engine.watchdog_timeout_s`` is reported once, with the stack of the thread running it
(naming the hook). A step costs two attribute writes (arming ``faulthandler`` per step cost ~50 us).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

TICK_S = 1.0  # seconds between two looks at the running step


class StepWatchdog:
    """Reports a step that runs longer than ``timeout_s`` seconds.

    Args:
        timeout_s: ``engine.watchdog_timeout_s``.
        on_hung: called once per hung step, on the watchdog thread, with the seconds it has run and the
            formatted stack of the thread running it.
    """

    def __init__(self, timeout_s: float, on_hung: Callable[[float, str], None]) -> None:
        self.timeout_s, self.on_hung = timeout_s, on_hung
        self._started: float | None = None  # time.monotonic() of the running step's start
        self._thread_id: int | None = None  # the thread running it
        self._reported: float | None = None  # the start of the step already reported
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Watch the body (one engine step)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="servelab-step-watchdog", daemon=True)
            self._thread.start()
        self._thread_id, self._started = threading.get_ident(), time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def close(self) -> None:
        """Stop the thread (it also ends with the process: daemon)."""
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(TICK_S):
            started = self._started
            if started is None or started == self._reported or time.monotonic() - started <= self.timeout_s:
                continue
            self._reported = started
            self.on_hung(time.monotonic() - started, _stack_of(self._thread_id))


def _stack_of(thread_id: int | None) -> str:
    """The formatted stack of a thread. No frame outlives the call: a frame kept by this daemon thread would
    hold the stepping thread's tensors until interpreter exit, where dropping them from a daemon thread
    aborts the process (torch re-acquires the GIL in a destructor during finalisation)."""
    frame = sys._current_frames().get(thread_id)
    try:
        return "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)"
    finally:
        del frame
