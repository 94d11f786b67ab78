"""Executor: runs the model's ranks for the engine (vLLM V1's ``Executor``).

The engine (the driver) keeps the only copy of engine state (scheduler, KV allocator, grammar
matchers, detokenizer, drafters) and talks to its workers through one executor: one verb,
:meth:`Executor.collective_rpc` (call a :class:`framework.worker.worker.Worker` method on every
rank), plus :meth:`Executor.execute_model`, which turns each ``SchedulerOutput`` into the step's
compact message (``framework.core.step_message``) and returns the driver rank's output, or, with
``non_block=True``, a :class:`StepFuture` of it (vLLM V1's batch queue: up to
:attr:`Executor.max_concurrent_batches` steps in flight, so pipeline stages overlap). Built-ins:
``uniproc`` (the worker in this process), ``mp`` (one spawned process per rank, the step broadcast
through shared memory), ``ray`` (one Ray actor per rank in a placement group).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from framework.core.clock import WALL_CLOCK, Clock
from framework.core.faults import EngineDeadError
from framework.core.step_message import StepMessageBuilder
from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    import torch

    from framework.config import EngineConfig
    from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
    from framework.interfaces.drafter import Drafter

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker raised while starting (weights, memory, device) or answering a call; the message
    carries the worker's rank and traceback."""


class StepFuture(Future):
    """The driver rank's ``ModelRunnerOutput`` of a step sent with ``execute_model(..., non_block=True)``
    (vLLM's ``FutureWrapper`` of its multiproc executor): a ``concurrent.futures.Future`` whose
    :meth:`result` collects the reply itself, on the calling thread, after the replies of every step sent
    before it (replies come back in step order). No thread of its own: nothing is read until someone asks.

    Args:
        resolve: ``resolve(future)`` collects the replies up to and including ``future``'s and sets them
            (the executor's :meth:`Executor._resolve_steps`).
    """

    def __init__(self, resolve: Callable[[StepFuture], None]) -> None:
        super().__init__()
        self._resolve = resolve

    def result(self, timeout: float | None = None) -> Any:
        """The step's output (collected now if it was not yet).

        Raises:
            EngineDeadError: a worker was lost during this step or an earlier one still in flight.
        """
        if not self.done():
            self._resolve(self)
        return super().result(timeout)


class Executor(Plugin, ABC):
    """Runs ``parallel.tensor_parallel_size`` worker ranks and answers for the driver rank (rank 0).

    Call order (``framework.engine.builder``): construction (starts the ranks and loads each one's
    model), :meth:`determine_available_memory` and :meth:`kv_cache_bytes_per_block`,
    :meth:`initialize_cache`, then :meth:`execute_model` once per step; :meth:`shutdown` last.

    Batches in flight (vLLM V1's ``max_concurrent_batches`` and ``execute_model(..., non_block=True)``): an
    executor whose ranks can run several steps at once (pipeline stages) says how many; the engine then
    sends up to that many steps before it waits for the oldest output (``framework.engine.batch_queue``). A
    subclass overrides :meth:`_send_step` (send now, return how to collect the reply later); the base
    keeps the sent steps in order and resolves their futures oldest first.

    Args:
        config: the engine config; workers receive a copy.
        params: ``executor.params`` of the config group.

    Attributes:
        clock: the run's time source (``framework.core.clock``), shared by the engine, scheduler, metrics
            and offline runner: :data:`~framework.core.clock.WALL_CLOCK` for executors that run a model; a
            simulator may give a virtual clock that its steps advance.
    """

    def __init__(self, config: EngineConfig, **params: Any) -> None:
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.params = params
        self._messages = StepMessageBuilder()
        self._failure_callbacks: list[Callable[[EngineDeadError], None]] = []
        self.dead: EngineDeadError | None = None  # set once a worker was lost
        # one call at a time: a call from another thread (a metrics read) must not interleave with a step
        self._rpc_lock = threading.RLock()
        self.clock: Clock = WALL_CLOCK
        # steps sent and not yet collected, oldest first: (future, collect its reply)
        self._pending_steps: deque[tuple[StepFuture, Callable[[], ModelRunnerOutput]]] = deque()

    @classmethod
    def wall_clock(cls, config: EngineConfig) -> bool:
        """Whether the engine's :attr:`clock` will follow wall time, known from ``config`` before anything starts
        (a server needs it: its clients wait in wall time). True here; ``executor=sim`` answers from its
        ``clock`` param."""
        return True

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the ranks can hold at once (vLLM V1's ``Executor.max_concurrent_batches``): 1 here (each
        step waits for the previous one's output); ``mp`` and ``ray`` say ``pipeline_parallel_size``."""
        return 1

    @abstractmethod
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, unique_reply_rank: int | None = None) -> list[Any]:
        """Call ``Worker.<method>(*args, **kwargs)`` on every rank, in parallel; thread-safe (calls from
        several threads run one after the other, under ``self._rpc_lock``).

        Args:
            method: a ``Worker`` method name, or a callable run as ``method(worker, *args, **kwargs)`` (vLLM's
                contract: tests and tools reach into the ranks; it must be importable there, i.e. a
                module-level function of an installed module).
            timeout_s: seconds to wait for the replies; ``None``: the executor's deadline for the call
                (``framework.executor.deadlines``; the in-process ``uniproc`` has none).
            unique_reply_rank: only this rank replies (``execute_model``: rank 0); others' results
                are dropped.

        Returns:
            The results in rank order (one element when ``unique_reply_rank`` is set).

        Raises:
            EngineDeadError: a worker died or timed out (the executor is then unusable).
            WorkerError: a worker raised (its traceback in the message).
        """

    @abstractmethod
    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` when a worker is gone; cheap, callable between steps."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and release shared resources (processes, shared memory, actors).
        Idempotent; also runs at interpreter exit."""

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Send the step's message (new requests in full, running ones as deltas) to every rank and
        return the driver rank's output; with ``non_block`` (vLLM V1's contract), return a
        :class:`StepFuture` of it at once, the step running behind the ones already in flight. Messages are
        built in call order, so every rank applies them in that order.

        Raises:
            EngineDeadError: a worker was lost during the step (from ``result()`` with ``non_block``).
        """
        with self._rpc_lock:
            collect = self._send_step(self._messages.build(scheduler_output), scheduler_output)
            future = StepFuture(self._resolve_steps)
            self._pending_steps.append((future, collect))
        return future if non_block else future.result()

    def _send_step(self, message: Any, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start one step on the ranks (under ``self._rpc_lock``, in step order) and return a function that
        waits for and returns the driver rank's reply. This default runs the step to its end now."""
        out = self.collective_rpc("execute_model", args=(message,), unique_reply_rank=0)[0]
        return lambda: out

    def _resolve_steps(self, until: StepFuture | None = None) -> None:
        """Collect the replies of the steps in flight, oldest first, up to and including ``until`` (``None``:
        all of them) and set their futures. A lost worker fails every step still in flight with its error."""
        with self._rpc_lock:
            while self._pending_steps and (until is None or not until.done()):
                future, collect = self._pending_steps.popleft()
                try:
                    future.set_result(collect())
                except EngineDeadError as error:
                    future.set_exception(error)
                    while self._pending_steps:
                        self._pending_steps.popleft()[0].set_exception(error)
                except BaseException as exc:  # noqa: BLE001 - the step's own failure, raised from its result()
                    future.set_exception(exc)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps sent and not yet collected."""
        return len(self._pending_steps)

    def determine_available_memory(self) -> int:
        """KV-cache bytes that fit every rank: the minimum over ranks."""
        return min(self.collective_rpc("determine_available_memory"))

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block on the largest rank (all layers, K and V)."""
        return max(self.collective_rpc("kv_cache_bytes_per_block"))

    def initialize_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        """Allocate ``num_blocks`` KV blocks (and swap blocks) on every rank and build the runners."""
        self.collective_rpc("initialize_cache", args=(num_blocks, num_swap_blocks))
        self._messages.null_block = num_blocks  # released sliding-window entries point here

    def register_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` once when a worker is lost (e.g. to fail in-flight requests)."""
        self._failure_callbacks.append(callback)

    def driver_model(self) -> torch.nn.Module | None:
        """The target model when its (only) rank lives in this process (``uniproc``), else ``None``;
        drafters that run on the driver and share the target's embedding and LM head (EAGLE) then
        get only those weights, loaded into the driver by ``build_engine``."""
        return None

    def run_labels(self) -> dict[str, Any]:
        """Labels every record of the run carries (``metrics.json``, each ``outputs.jsonl`` line, the W&B
        summary): ``simulated`` (False: this executor runs the model) and ``sim_profile`` (the cost
        model's source; ``None`` here). Simulators override it."""
        return {"simulated": False, "sim_profile": None}

    def simulated_drafter(self, drafter: Drafter) -> Drafter | None:
        """A stand-in for ``drafter`` when this executor simulates the model (no weights, so no draft
        model or hidden states to draft from), else ``None`` (the default): ``build_engine`` then loads
        ``drafter`` as usual. Called once, before the drafter's ``load``."""
        return None

    def _fail(self, error: EngineDeadError) -> EngineDeadError:
        """Record a lost worker once, run the failure callbacks, return the error to raise."""
        if self.dead is None:
            self.dead = error
            logger.error("executor %s: %s", self.name, error)
            for callback in self._failure_callbacks:
                callback(error)
        return self.dead
