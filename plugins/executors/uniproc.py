"""``executor=uniproc``: the one worker rank in the engine's own process (vLLM's ``UniProcExecutor``).

The default for ``parallel.tensor_parallel_size=1``. Each step goes through exactly the message
path of the multi-process executors (``StepMessage`` -> the worker's ``InputBatch``), without
serialisation: the message object is handed to the worker as is.
"""

from __future__ import annotations

from typing import Any

import torch

from framework import hookimpl
from framework.config import EngineConfig
from framework.hookspecs import Register
from framework.interfaces import Executor
from framework.worker.worker import Worker
from framework.worker.worker_proc import run_method


class UniProcExecutor(Executor):
    """One :class:`framework.worker.worker.Worker` (rank 0 of 1) in this process; errors while it
    loads (missing weights, a quant method that refuses the model) propagate unchanged."""

    name = "uniproc"

    def __init__(self, config: EngineConfig, **params: Any) -> None:
        super().__init__(config, **params)
        self.worker = Worker(config, rank=0, world_size=1)
        self.worker.init_device()
        self.worker.load_model()

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """One rank only."""
        problems = super().validate(config)
        if config.tensor_parallel_size != 1:
            problems.append(f"executor=uniproc runs one rank but parallel.tensor_parallel_size="
                            f"{config.tensor_parallel_size}; use executor=mp (or executor=auto, or ray)")
        return problems

    def collective_rpc(self, method: str | Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, unique_reply_rank: int | None = None) -> list[Any]:
        """Call the in-process worker directly, one call at a time (``timeout_s`` is moot: the call is
        synchronous; a hung call is the engine loop's watchdog's to report)."""
        with self._rpc_lock:
            return [run_method(self.worker, method, args, kwargs or {})]

    def check_health(self) -> None:
        """The worker lives as long as this process."""

    def shutdown(self) -> None:
        """Nothing to stop."""

    def driver_model(self) -> torch.nn.Module | None:
        """The worker's model itself (same process)."""
        return self.worker.loaded.model

    @property
    def runner(self) -> Any:
        """The worker's model runner (inspection, tests, experiments)."""
        return self.worker.runner


@hookimpl
def register_executors(register: Register) -> None:
    """Register ``uniproc``."""
    register("uniproc", UniProcExecutor)
