"""Structured-output requests between ``add_request`` and the scheduler, and their matchers after a step.

A request with ``structured_outputs`` waits here while its grammar compiles on the manager's threads (vLLM V1
keeps such requests in the scheduler's waiting queue with status ``WAITING_FOR_FSM``; here they stay out of the
scheduler, so a policy never sees a request it cannot run). After each step the matchers advance on the tokens
the scheduler appended. Requests finished here are returned to the engine, which reports them.
"""

from __future__ import annotations

from collections.abc import Iterable

from framework.core.clock import Clock
from framework.core.faults import RequestFaults
from framework.core.outputs import SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.core.scheduler import Scheduler
from framework.core.structured_output import StructuredOutputManager


class StructuredOutputGate:
    """The engine's side of structured outputs (``framework.core.structured_output`` holds the matchers).

    Args:
        manager: the grammar plugin's manager, or ``None`` when the engine was built without a grammar
            (then nothing is ever held and every method is a no-op).
        scheduler: where compiled requests go.
        faults: the engine's per-request fault record (a grammar plugin that raises is recorded there).
        clock: the engine's clock (seconds), for ``finished_s`` of requests failed here.
    """

    def __init__(self, manager: StructuredOutputManager | None, scheduler: Scheduler, faults: RequestFaults,
                 clock: Clock) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.clock = clock
        self.faults = faults
        self.compiling: dict[str, Request] = {}  # request id -> request whose grammar compiles
        if manager is not None:
            manager.faults = faults

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.compiling

    def __len__(self) -> int:
        return len(self.compiling)

    def submit(self, request: Request) -> bool:
        """Hold ``request`` while its grammar compiles; False (nothing held) when it has no grammar."""
        if request.sampling_params.structured_outputs is None:
            return False
        self.manager.submit(request)
        self.compiling[request.request_id] = request
        return True

    def admit(self) -> list[Request]:
        """Hand requests whose grammar compiled to the scheduler; returns those whose compile failed, finished
        as aborted with the error. Waits up to 50 ms for a compile when the scheduler has nothing to run."""
        if not self.compiling:
            return []
        if not self.scheduler.has_unfinished_requests():
            self.manager.wait_any(timeout_s=0.05)
        failed = []
        for rid in [r for r in self.compiling if self.manager.is_ready(r)]:
            request = self.compiling.pop(rid)
            error = self.manager.start(request)
            if error is None:
                self.scheduler.add_request(request)
            else:
                failed.append(self._finish(request, error))
        return failed

    def fail(self, request_ids: Iterable[str] | None, error: str | None) -> list[Request]:
        """Finish the held requests among ``request_ids`` (``None``: all of them) as aborted (``error``: why, or
        ``None`` for a user abort); returns them."""
        ids = list(self.compiling if request_ids is None else request_ids)
        return [self._finish(self.compiling.pop(rid), error) for rid in ids if rid in self.compiling]

    def _finish(self, request: Request, error: str | None) -> Request:
        self.manager.discard(request.request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        request.error = error
        request.times.finished_s = self.clock.now()
        return request

    def discard(self, request_id: str) -> None:
        """Drop a scheduled request's matcher (it finished or was aborted)."""
        if self.manager is not None:
            self.manager.discard(request_id)

    def fill_bitmask(self, sched_out: SchedulerOutput) -> None:
        """Set ``sched_out``'s grammar bitmask (packed int32, one row per constrained token) for the workers."""
        if self.manager is not None and sched_out.total_num_scheduled_tokens:
            sched_out.grammar_bitmask, sched_out.structured_output_request_ids = (
                self.manager.grammar_bitmask(sched_out))

    def advance(self, updated: list[Request]) -> None:
        """Advance matchers on the tokens the scheduler appended to ``updated``; a terminated grammar finishes
        its request with ``stop`` (a violating token is a fault: the manager records it in the engine's faults)."""
        if self.manager is None:
            return
        for request in updated:
            if self.faults.failed(request.request_id):
                continue  # aborted after this update anyway
            terminated = self.manager.advance(request)
            if request.is_finished:
                self.manager.discard(request.request_id)
            elif terminated:
                self.scheduler.abort_requests([request.request_id])
                self.manager.discard(request.request_id)
                request.status = RequestStatus.FINISHED_STOPPED

    def shutdown(self) -> None:
        """Stop the grammar compile threads."""
        if self.manager is not None:
            self.manager.shutdown()
