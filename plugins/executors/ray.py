"""``executor=ray``: one Ray actor per rank in a placement group (vLLM's ``RayDistributedExecutor``).

Needs the ``ray`` extra (``pip install "servelab[ray]" "torch==2.13.0"``). With
``executor.params.address=null`` the executor joins the cluster named by ``$RAY_ADDRESS`` or starts
a local one (stopped again at shutdown); ``address=auto`` (or ``ray://...``, ``host:port``) joins a
running cluster started with ``ray start --head`` / ``ray start --address=...``, whose nodes then
host the ranks: the placement group packs the bundles (``placement_strategy``), and rank 0's node
hosts the ``torch.distributed`` rendezvous. Each call's arguments are put in the object store once
(``ray.put``) and every actor reads the same object: the step's message is serialised once.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import traceback
from typing import Any

from framework import hookimpl
from framework.config import EngineConfig
from framework.hookspecs import Register
from framework.interfaces import EngineDeadError, Executor, WorkerError

logger = logging.getLogger(__name__)
INSTALL_HINT = 'pip install "servelab[ray]" "torch==2.13.0"'


class _RankActor:
    """The body of one rank's Ray actor: a :class:`framework.worker.worker.Worker` and a call verb."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.worker: Any = None

    def rendezvous_address(self) -> str:
        """``tcp://<this node's IP>:<free port>`` for torch.distributed (asked of rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, init_method: str | None) -> None:
        """Build the worker: device, this rank's model shard, attention backend."""
        from framework.config import EngineConfig
        from framework.worker.worker import Worker

        try:
            self.worker = Worker(EngineConfig(**self.config), self.rank, self.world_size, init_method, own_process=True)
            self.worker.init_device()
            self.worker.load_model()
        except BaseException as exc:  # noqa: BLE001 - the driver shows the rank's traceback
            raise RuntimeError(f"worker rank {self.rank} failed to start:\n{traceback.format_exc()}") from exc

    def call(self, payload: tuple[str, tuple, dict[str, Any], int | None]) -> Any:
        """Run ``Worker.<method>``; ranks other than the reply rank return ``None``."""
        method, args, kwargs, reply_rank = payload
        result = getattr(self.worker, method)(*args, **kwargs)
        return result if reply_rank is None or reply_rank == self.rank else None


class RayExecutor(Executor):
    """``parallel.tensor_parallel_size`` Ray actors, one per rank, in one placement group.

    Args:
        address: Ray cluster to join (``auto``, ``host:port``, ``ray://...``); ``None``: ``$RAY_ADDRESS``
            or a new local cluster.
        placement_strategy: ``PACK`` (default: few nodes), ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``.
        num_cpus_per_worker: CPUs reserved per rank.
        execute_timeout_s: seconds a call may take before the executor is declared dead.

    Raises:
        WorkerError: a rank failed to start (its traceback), or the cluster cannot host the ranks.
    """

    name = "ray"

    def __init__(self, config: EngineConfig, address: str | None = None, placement_strategy: str = "PACK",
                 num_cpus_per_worker: float = 1.0, execute_timeout_s: float = 300.0, **params: Any) -> None:
        super().__init__(config, **params)
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.execute_timeout_s = execute_timeout_s
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=True)
        gpus = 1.0 if config.device.startswith("cuda") else 0.0
        bundle = {"CPU": num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self._pg = ray.util.placement_group([bundle] * self.world_size, strategy=placement_strategy)
        self.actors: list[Any] = []
        try:
            ray.get(self._pg.ready(), timeout=60)
            actor_cls = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=gpus)(_RankActor)
            self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(
                config.to_dict(), rank, self.world_size) for rank in range(self.world_size)]
            init_method = ray.get(self.actors[0].rendezvous_address.remote()) if self.world_size > 1 else None
            ray.get([a.start.remote(init_method) for a in self.actors])
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.shutdown()
            raise WorkerError(f"executor=ray could not start its ranks: {_cause(exc)}") from None

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Ray must be installed."""
        problems = super().validate(config)
        if importlib.util.find_spec("ray") is None:
            problems.append(f"executor=ray needs Ray, which is not installed: {INSTALL_HINT}")
        return problems

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, unique_reply_rank: int | None = None) -> list[Any]:
        """Put the call in the object store once, run it on every actor, gather (see :class:`Executor`)."""
        import ray

        if self.dead is not None:
            raise self.dead
        payload = ray.put((method, args, kwargs or {}, unique_reply_rank))
        refs = [a.call.remote(payload) for a in self.actors]
        try:
            results = ray.get(refs, timeout=timeout_s)
        except ray.exceptions.RayActorError as exc:
            raise self._lost(f"an actor died during {method!r}: {_cause(exc)}") from None
        except ray.exceptions.GetTimeoutError:
            raise self._lost(f"no reply to {method!r} within {timeout_s} s") from None
        except ray.exceptions.RayTaskError as exc:
            if method == "execute_model":
                raise self._lost(f"a rank failed in execute_model: {_cause(exc)}") from None
            raise WorkerError(f"a rank failed in {method}: {_cause(exc)}") from None
        return [results[unique_reply_rank]] if unique_reply_rank is not None else results

    def execute_model(self, scheduler_output: Any) -> Any:
        """As :meth:`Executor.execute_model`, under ``execute_timeout_s``."""
        message = self._messages.build(scheduler_output)
        return self.collective_rpc("execute_model", args=(message,), timeout_s=self.execute_timeout_s,
                                   unique_reply_rank=0)[0]

    def check_health(self) -> None:
        """Ping every actor (10 s); a dead or silent one makes the executor dead."""
        if self.dead is not None:
            raise self.dead
        self.collective_rpc("check_health", timeout_s=10.0)

    def _lost(self, reason: str) -> EngineDeadError:
        error = self._fail(EngineDeadError(f"executor=ray lost a worker: {reason}"))
        self.shutdown()
        return error

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group; stop Ray if this executor started it."""
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


def _cause(exc: BaseException) -> str:
    """The innermost error text of a Ray exception (the rank's traceback for a task error)."""
    return str(getattr(exc, "cause", None) or exc)


@hookimpl
def register_executors(register: Register) -> None:
    """Register ``ray``."""
    register("ray", RayExecutor)
