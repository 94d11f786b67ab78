"""The engine's batches in flight (vLLM V1's ``EngineCore.batch_queue`` and ``step_with_batch_queue``).

``LLMEngine.step`` sends each scheduled batch through :meth:`BatchQueue.submit` and applies outputs it takes
back from :meth:`BatchQueue.pop_oldest`. With an executor whose ``max_concurrent_batches`` is N > 1 (pipeline
parallelism: one batch per stage) a step schedules and submits while fewer than N batches are in flight, and
waits for the oldest one only when the queue is full or nothing new could be scheduled (every schedulable
request has a step in flight: ``Scheduler.in_flight``), so stage 0 runs batch k+1 while stage 1 runs batch k.
With N = 1 every step submits and waits at once: the synchronous loop, through the same code.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
from framework.interfaces import Executor


@dataclass
class InFlightBatch:
    """One submitted batch."""

    scheduler_output: SchedulerOutput  # what the scheduler chose; applied with its output, in submission order
    future: Future  # the driver rank's ModelRunnerOutput (Executor.execute_model's, non_block with N > 1)
    times: tuple[float, float]  # (step start, schedule end), engine clock seconds, for the step's stats


class BatchQueue:
    """Up to ``executor.max_concurrent_batches`` batches in flight, oldest first.

    Args:
        executor: runs the batches; its ``max_concurrent_batches`` is the queue's size.

    Attributes:
        max_batches: the queue's size (``Executor.max_concurrent_batches``, at least 1).
        peak_in_flight: the most batches that were in flight at once so far (1 on a synchronous executor;
            2 proves pipeline stages overlapped).
        num_submitted: batches submitted so far.
    """

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.max_batches = max(1, int(executor.max_concurrent_batches))
        self._queue: deque[InFlightBatch] = deque()
        self.peak_in_flight = 0
        self.num_submitted = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def full(self) -> bool:
        """True when a new batch must wait for the oldest one's output."""
        return len(self._queue) >= self.max_batches

    def submit(self, scheduler_output: SchedulerOutput, times: tuple[float, float]) -> None:
        """Send one batch to the executor: non-blocking when the queue holds more than one batch
        (``execute_model(..., non_block=True)``), else run it now (any executor, its own ``execute_model``).

        Raises:
            EngineDeadError: the executor was lost while sending (or, synchronously, running) the batch.
        """
        if self.max_batches > 1:
            future = self.executor.execute_model(scheduler_output, non_block=True)
        else:
            future = Future()
            future.set_result(self.executor.execute_model(scheduler_output))
        self._queue.append(InFlightBatch(scheduler_output, future, times))
        self.num_submitted += 1
        self.peak_in_flight = max(self.peak_in_flight, len(self._queue))

    def pop_oldest(self) -> tuple[SchedulerOutput, ModelRunnerOutput, tuple[float, float]]:
        """Wait for the oldest batch's output and take it off the queue.

        Raises:
            EngineDeadError: a worker was lost during this batch or one before it.
            IndexError: nothing in flight.
        """
        batch = self._queue[0]
        try:
            out: Any = batch.future.result()
        finally:
            self._queue.popleft()
        return batch.scheduler_output, out, batch.times

    def clear(self) -> None:
        """Forget every batch in flight (the executor is dead: their requests were failed)."""
        self._queue.clear()
