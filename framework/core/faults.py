"""Per-request fault isolation, and the one fault class that stops the engine (issue 34).

An exception raised by code that works for a single request is that request's failure, not the
engine's. The per-request call sites of a step run under :meth:`RequestFaults.guard` (or
:meth:`RequestFaults.call`): the detokenizer and stop checker (``Scheduler.update_from_output``), the
grammar matcher (every per-request method of ``StructuredOutputManager``) and the drafter's proposal
for the request (``LLMEngine``). A guarded exception is logged and recorded as the request's error
text; at fixed points of the step the engine aborts the recorded requests through the scheduler
(``finish_reason="abort"``, ``error`` set, ``RequestOutput.internal_error`` true, blocks freed) and
every other request carries on. Lifecycle hooks are isolated per plugin instead
(:func:`framework.registry.call_hook`): they report on a request or a step, so a failing observer is
only logged.

What is not attributable to one request (the model forward, a KV-cache write, the scheduler policy or
KV allocator) leaves engine state unknown: the caller of ``LLMEngine.step`` (``AsyncLLM``, ``LLM``)
then raises :class:`EngineDeadError` to every in-flight request, as vLLM V1 does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine hit a fault that leaves its state unknown (model forward, KV-cache write, scheduler):
    every in-flight request is failed and the engine must be rebuilt (a server exits non-zero so that
    its supervisor restarts it). Named after vLLM V1's ``EngineDeadError``; ``__cause__`` holds the fault.

    Executors raise it too, when they lose a worker (killed, crashed, hung past its timeout), from
    ``execute_model``, ``collective_rpc`` and ``check_health``; ``LLMEngine.step`` then sets
    ``outputs`` to the final (aborted) outputs of every in-flight request before re-raising.
    """

    outputs: list = []  # RequestOutput of every request the death finished (set by LLMEngine.step)


@dataclass(frozen=True)
class RequestFailure:
    """Why the engine ends one request early (``finish_reason="abort"``)."""

    error: str  # what failed, for the caller (``RequestOutput.error``)
    internal: bool = True  # a fault of the server (a plugin or the detokenizer raised), else of the request itself


class RequestFaults:
    """Failures of single requests collected during engine steps, by request id (the first one wins).

    Shared by the scheduler, the structured-output manager and the engine (the engine wires one
    instance into each); only the engine loop's thread uses it.
    """

    def __init__(self) -> None:
        self._failures: dict[str, RequestFailure] = {}  # request_id -> why it fails, until the engine takes it
        self._logged: set[str] = set()  # call sites whose traceback was logged once already

    @contextlib.contextmanager
    def guard(self, request_id: str, what: str) -> Iterator[None]:
        """Run the ``with`` body for ``request_id``; an exception in it is recorded (see :meth:`record`)
        and suppressed, so the caller continues with the next request. ``what`` names the failing part
        (a plugin by its registry name, e.g. ``"grammar 'xgrammar' matcher"``)."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - any fault of one request's code fails that request only
            self.record(request_id, what, exc)

    def call(self, request_id: str, what: str, fn: Callable[..., T], *args: Any, default: T) -> T:
        """``fn(*args)`` under :meth:`guard`; ``default`` when it raised."""
        with self.guard(request_id, what):
            return fn(*args)
        return default

    def record(self, request_id: str, what: str, exc: BaseException | str) -> None:
        """Record that ``what`` failed on ``request_id`` (an exception, or a message when nothing
        raised, e.g. a drafter's out-of-vocabulary token); logs the traceback once per ``what``."""
        detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        text = f"{what} failed on this request: {detail}"
        first = what not in self._logged
        self._logged.add(what)
        logger.warning("request %s aborted: %s", request_id, text,
                       exc_info=exc if first and isinstance(exc, BaseException) else None)
        self._failures.setdefault(request_id, RequestFailure(text))

    def reject(self, request_id: str, message: str) -> None:
        """Record that the request itself cannot go on (e.g. its grammar allows no token): a rejection, not a
        fault of the server (``internal`` false)."""
        logger.info("request %s aborted: %s", request_id, message)
        self._failures.setdefault(request_id, RequestFailure(message, internal=False))

    def failed(self, request_id: str) -> bool:
        """True when a failure of ``request_id`` is recorded and not yet taken."""
        return request_id in self._failures

    def take(self) -> dict[str, RequestFailure]:
        """Every recorded failure by request id, forgetting them."""
        failures, self._failures = self._failures, {}
        return failures

    def __bool__(self) -> bool:
        return bool(self._failures)
