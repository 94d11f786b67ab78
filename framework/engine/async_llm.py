"""``AsyncLLM``: an asyncio front end over one engine loop (vLLM V1 ``AsyncLLM`` shape, in-process).

One background thread owns the :class:`~framework.engine.llm_engine.LLMEngine`: it steps while requests are
pending and blocks on its command queue when idle. ``add_request``/``abort`` from any thread or
event loop are commands on that queue, drained between steps, so engine state is never touched
from two threads and new requests join the running batch at the next step boundary. Outputs go
back to each caller's event loop with ``call_soon_threadsafe``.

Faults (issues 34, 44): a request the engine fails (a plugin raised on it) ends with its own error
output; an exception escaping ``engine.step()`` leaves the engine's state unknown, so the loop stops,
every in-flight and later request gets :class:`~framework.core.faults.EngineDeadError`, and ``on_dead``
is called (the server then exits non-zero, as ``vllm serve`` does). A step that runs longer than
``engine.watchdog_timeout_s`` (a plugin hook that never returns) is treated the same way by a watchdog
thread, which logs the loop thread's stack (SGLang's ``watchdog_timeout``). ``generate`` enqueues under
the lock the loop's exit takes, so a request is either seen by the loop or refused: never left waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from framework.core.faults import EngineDeadError
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.llm_engine import LLMEngine
from framework.engine.watchdog import StepWatchdog

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # seconds the idle loop blocks on the command queue before re-checking shutdown


@dataclasses.dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue owned by the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or an Exception (rejection / engine failure)

    def put(self, item: RequestOutput | Exception) -> bool:
        """Hand ``item`` to the caller's loop; False when that loop is closed (the caller is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": never let a vanished caller kill the engine loop
            return False
        return True


class AsyncLLM:
    """Asynchronous generation over one engine; thread-safe, many concurrent ``generate`` calls.

    Args:
        engine: a built engine; from now on only this object's loop thread may touch it.
        on_dead: called once, on the loop thread (the watchdog's for a hung step), with the fault when
            the engine dies (after every in-flight request got its ``EngineDeadError``).
        startup: run once on the loop thread before any request (a server's compile warm-up,
            ``engine.maybe_compile(None)``); requests queue meanwhile, :attr:`ready` is False and
            :attr:`startup_s` counts. An exception in it kills the engine like one in a step.

    Use :meth:`shutdown` (or ``async with``) to abort everything in flight and stop the loop.
    """

    def __init__(self, engine: LLMEngine, on_dead: Callable[[BaseException], None] | None = None,
                 startup: Callable[[], Any] | None = None) -> None:
        self.engine = engine
        self.on_dead = on_dead
        self._startup = startup
        self._ready = threading.Event()
        self._t0 = self._ready_at = time.monotonic()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self.errored: BaseException | None = None  # set if the loop died; new requests then fail
        # generate's check-and-enqueue vs the loop's exit: a queued command is drained or its caller refused
        self._lock = threading.Lock()
        self._closed = False  # the loop took its last command (under _lock)
        self._watchdog = StepWatchdog(float(engine.config.watchdog_timeout_s), self._hung)
        self._thread = threading.Thread(target=self._run, name="servelab-engine-loop", daemon=True)
        self._thread.start()

    # ---- caller side ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs as the engine produces them.

        Outputs follow ``sampling_params.output_kind`` (default here: ``DELTA``, i.e. only new
        text/tokens per output). The last output has ``finished=True``. Leaving the loop early
        (``break``, task cancellation, client disconnect) aborts the request: its blocks are
        freed at the next step boundary.

        Raises:
            ValueError: the engine rejected the request (bad prompt/params, duplicate id).
            EngineDeadError: the engine died (before or while this request ran).
            RuntimeError: the engine loop is shut down.
        """
        params = sampling_params or SamplingParams(output_kind=RequestOutputKind.DELTA)
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # the loop cannot exit between this check and the enqueue
            if self.errored is not None:
                raise self._dead_error()
            if self._stopping.is_set() or self._closed:
                raise RuntimeError("the engine loop is not running (shut down)")
            self._commands.put(("add", request_id, (prompt, params, priority), stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its stream gets a final ``finish_reason="abort"`` output."""
        self._commands.put(("abort", request_id, None, None))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort every in-flight request (each stream gets its final output) and stop the loop thread."""
        self._stopping.set()
        self._commands.put(("stop", "", None, None))
        self._thread.join(timeout_s)

    @property
    def ready(self) -> bool:
        """True once the start-up work (``startup``) is done and requests are served."""
        return self._ready.is_set()

    @property
    def startup_s(self) -> float:
        """Seconds the start-up work has run so far (its whole time once :attr:`ready`)."""
        return (self._ready_at if self._ready.is_set() else time.monotonic()) - self._t0

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and not shutting down."""
        return self._thread.is_alive() and not self._stopping.is_set()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.shutdown)

    # ---- loop thread -----------------------------------------------------------------
    def _dead_error(self) -> EngineDeadError:
        exc = self.errored
        error = EngineDeadError(f"the engine died ({type(exc).__name__}: {exc}); its state is unknown, every "
                                "in-flight request failed; restart the engine (the server exits for its supervisor "
                                "to restart it)")
        error.__cause__ = exc
        return error

    def _run(self) -> None:
        try:
            if self._startup is not None:
                self._startup()
            self._ready_at = time.monotonic()
            self._ready.set()
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain(block=not busy)
                if not busy:  # a worker lost while idle kills the loop too (so /health turns 503)
                    self.engine.check_health()
                if self.engine.has_unfinished_requests() and not self._stopping.is_set():
                    with self._watchdog.step():
                        outputs = self.engine.step()
                    if self.errored is not None:  # the watchdog gave up on this step meanwhile
                        return
                    self._dispatch(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting stream
            logger.exception("engine loop died: every in-flight request fails with EngineDeadError")
            self._die(exc)
            return
        finally:
            self._watchdog.close()
        with self._lock:
            self._closed = True
            self._drain(block=False)
        self._dispatch(self.engine.abort_request(list(self._streams)))

    def _die(self, exc: BaseException) -> None:
        """Fail every in-flight request and every queued one with ``EngineDeadError``, then ``on_dead`` (once)."""
        with self._lock:
            if self.errored is not None:
                return
            self.errored = exc
            self._closed = True
            streams = list(self._streams.values())
            self._streams.clear()
            while True:  # commands queued before the loop died: their callers wait on these streams
                try:
                    kind, _, _, stream = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    streams.append(stream)
        for stream in streams:
            stream.put(self._dead_error())
        if self.on_dead is not None:
            self.on_dead(exc)

    def _hung(self, seconds: float, stack: str) -> None:
        """The watchdog's verdict on a step past ``engine.watchdog_timeout_s``: log where it hangs, kill the loop."""
        limit = self._watchdog.timeout_s
        logger.error("engine step running for %.0f s (engine.watchdog_timeout_s=%g): hung; the loop thread is at:\n%s",
                     seconds, limit, stack)
        self._die(TimeoutError(f"an engine step made no progress for {limit:g} s (engine.watchdog_timeout_s); "
                               "a plugin hook or the forward hangs (its stack is in the log)"))

    def _drain(self, block: bool) -> None:
        """Apply queued commands; when ``block``, wait (idle) for the first one."""
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, request_id: str, payload: Any, stream: _Stream | None) -> None:
        if kind == "add":
            prompt, params, priority = payload
            if request_id in self._streams:
                stream.put(ValueError(f"request_id {request_id!r} is already in use; use a unique id"))
                return
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority)
            except Exception as exc:  # noqa: BLE001 - add_request changes nothing before it raises
                if isinstance(exc, EngineDeadError):  # the engine's fault, not the request's: 503, not 400
                    stream.put(exc)
                    return
                if not isinstance(exc, ValueError):
                    logger.exception("add_request(%r) raised; the request is rejected", request_id)
                    exc = ValueError(f"request rejected: {type(exc).__name__}: {exc}")
                stream.put(exc)
                return
            self._streams[request_id] = stream
        elif kind == "abort":
            self._dispatch(self.engine.abort_request(request_id))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            if not stream.put(output) and not output.finished:  # its caller's loop is gone: stop computing it
                del self._streams[output.request_id]
                self.engine.abort_request(output.request_id)
