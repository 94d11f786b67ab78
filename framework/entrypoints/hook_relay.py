"""Lifecycle hooks delivered off the engine loop: a plugin that queues every hook call and replays it on a
background thread to a wrapped observer (a tracker), so slow logging (W&B) never stalls a step.

Used by ``mode=serve`` for the tracker; the observer sees the same calls, in the same order, later.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from framework.hookspecs import hookimpl

logger = logging.getLogger(__name__)

_HOOKS = ("on_engine_start", "on_step_end", "on_request_finished", "on_run_end")


class ThreadedHookRelay:
    """Register this instead of ``target``: each lifecycle hook is queued (O(1) on the caller's thread) and
    called on ``target`` by one background thread, in call order. An exception in ``target`` is logged
    and does not stop later calls.

    Args:
        target: an object with some of ``on_engine_start``/``on_step_end``/``on_request_finished``/
            ``on_run_end`` (keyword arguments as in ``framework.hookspecs``).

    Call :meth:`close` (drains the queue, joins the thread) before closing ``target``.
    """

    def __init__(self, target: Any) -> None:
        self.target = target
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="servelab-hook-relay", daemon=True)
        self._thread.start()

    def _put(self, hook: str, kwargs: dict[str, Any]) -> None:
        if getattr(self.target, hook, None) is not None:
            self._queue.put((hook, kwargs))

    @hookimpl
    def on_engine_start(self, config: dict[str, Any]) -> None:
        """Queue ``target.on_engine_start(config=...)``."""
        self._put("on_engine_start", {"config": config})

    @hookimpl
    def on_step_end(self, stats: Any) -> None:
        """Queue ``target.on_step_end(stats=...)``."""
        self._put("on_step_end", {"stats": stats})

    @hookimpl
    def on_request_finished(self, output: Any) -> None:
        """Queue ``target.on_request_finished(output=...)``."""
        self._put("on_request_finished", {"output": output})

    @hookimpl
    def on_run_end(self, summary: dict[str, Any]) -> None:
        """Queue ``target.on_run_end(summary=...)``."""
        self._put("on_run_end", {"summary": summary})

    def close(self, timeout_s: float = 60.0) -> None:
        """Deliver everything queued, then stop the thread (waits at most ``timeout_s`` seconds)."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            hook, kwargs = item
            try:
                getattr(self.target, hook)(**kwargs)
            except Exception:  # noqa: BLE001 - an observer's bug must not kill the relay
                logger.exception("%s.%s failed", type(self.target).__name__, hook)
