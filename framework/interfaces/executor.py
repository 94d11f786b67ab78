"""Executor: runs the model's ranks for the engine (vLLM V1's ``Executor``).

The engine (the driver) keeps the only copy of engine state (scheduler, KV allocator, grammar
matchers, detokenizer, drafters) and talks to its workers through one executor: one verb,
:meth:`Executor.collective_rpc` (call a :class:`framework.worker.worker.Worker` method on every
rank), plus :meth:`Executor.execute_model`, which turns each ``SchedulerOutput`` into the step's
compact message (``framework.core.step_message``) and returns the driver rank's output. Built-ins:
``uniproc`` (the worker in this process), ``mp`` (one spawned process per rank, the step broadcast
through shared memory), ``ray`` (one Ray actor per rank in a placement group).
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
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


class Executor(Plugin, ABC):
    """Runs ``parallel.tensor_parallel_size`` worker ranks and answers for the driver rank (rank 0).

    Call order (``framework.engine.builder``): construction (starts the ranks and loads each one's
    model), :meth:`determine_available_memory` and :meth:`kv_cache_bytes_per_block`,
    :meth:`initialize_cache`, then :meth:`execute_model` once per step; :meth:`shutdown` last.

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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step's message (new requests in full, running ones as deltas) to every rank and
        return the driver rank's output.

        Raises:
            EngineDeadError: a worker was lost during the step.
        """
        message = self._messages.build(scheduler_output)
        return self.collective_rpc("execute_model", args=(message,), unique_reply_rank=0)[0]

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
