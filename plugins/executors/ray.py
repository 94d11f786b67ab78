"""``executor=ray``: one Ray actor per rank in a placement group (vLLM's ``RayDistributedExecutor``).

Needs the ``ray`` extra (``pip install "servelab[ray]" "torch==2.13.0"``). With
``executor.params.address=null`` the executor joins the cluster named by ``$RAY_ADDRESS`` or starts
a local one (stopped again at shutdown); ``address=auto`` (or ``ray://...``, ``host:port``) joins a
running cluster started with ``ray start --head`` / ``ray start --address=...``, whose nodes then
host the ranks: the placement group packs the bundles (``placement_strategy``), and rank 0's node
hosts the ``torch.distributed`` rendezvous. Each call's arguments are put in the object store once
(``ray.put``) and every actor reads the same object: the step's message is serialised once.

Failures (``framework.executor.deadlines``): the driver waits for the ranks' answers one at a time
(``ray.wait``), so a rank that dies or raises ends the call at once instead of after the other ranks
(rank 0 would otherwise sit in a collective with the dead rank until its timeout); between ticks of at
most a second it checks the call's deadline and, once a call has taken longer than a tick, pings every
actor on a concurrency group of its own (``health``): an actor that does not answer within
``heartbeat_timeout_s`` is stopped or stuck holding the GIL. Either way every actor is killed. A local
instance this executor started is stopped with its driver even when the driver is SIGKILLed
(``_ray_reaper``: Ray's own agents would outlive it by about a minute).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import time
import traceback
from typing import Any

from framework import hookimpl
from framework.config import EngineConfig
from framework.executor.deadlines import Deadlines, StepDeadline
from framework.executor.kv_output_aggregator import KVOutputAggregator
from framework.hookspecs import Register
from framework.interfaces import EngineDeadError, Executor, WorkerError
from framework.model_executor.pipeline_parallel import pipeline_refusals
from framework.worker.worker_proc import run_method
from plugins.executors._ray_reaper import start_reaper, stop_reaper

logger = logging.getLogger(__name__)
INSTALL_HINT = 'pip install "servelab[ray]" "torch==2.13.0"'
_TICK_S = 1.0  # longest ray.wait between two checks of deadline and pings


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

    def call(self, payload: tuple[Any, tuple, dict[str, Any], int | None]) -> Any:
        """Run ``Worker.<method>`` (or a callable on the worker); ranks other than the reply rank return ``None``."""
        method, args, kwargs, reply_rank = payload
        result = run_method(self.worker, method, args, kwargs)
        return result if reply_rank is None or reply_rank == self.rank else None


def _actor_class(ray: Any, num_cpus: float, num_gpus: float) -> Any:
    """``_RankActor`` as a Ray actor class whose ``ping`` runs on a concurrency group of its own
    (``health``), so it answers while a call runs; calls keep one thread (the default group's)."""

    class RankActor(_RankActor):
        @ray.method(concurrency_group="health")
        def ping(self) -> int:
            """This actor's pid: its process is alive and not stopped."""
            return os.getpid()

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, concurrency_groups={"health": 1})(RankActor)


class RayExecutor(Executor):
    """``parallel.tensor_parallel_size x parallel.pipeline_parallel_size`` Ray actors, one per rank, in one
    placement group. Under pipeline parallelism rank ``r`` is TP rank ``r % tp`` of stage ``r // tp`` and the
    first rank of the last stage (:attr:`driver_rank`) samples and replies, as with ``mp``; one batch in flight.

    Args:
        address: Ray cluster to join (``auto``, ``host:port``, ``ray://...``); ``None``: ``$RAY_ADDRESS``
            or a new local cluster.
        placement_strategy: ``PACK`` (default: few nodes), ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``.
        num_cpus_per_worker: CPUs reserved per rank.
        **params: the bounds of :class:`~framework.executor.deadlines.Deadlines`, seconds (as ``mp``).

    Raises:
        WorkerError: a rank failed to start (its traceback), or the cluster cannot host the ranks.
    """

    name = "ray"

    def __init__(self, config: EngineConfig, address: str | None = None, placement_strategy: str = "PACK",
                 num_cpus_per_worker: float = 1.0, **params: Any) -> None:
        self.deadlines, params = Deadlines.from_params(params)
        super().__init__(config, **params)
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.driver_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size  # samples, replies
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.step_deadline = StepDeadline(self.deadlines)
        # kv_connector: every rank's worker side reports its shard's transfers, merged each step (as executor=mp)
        self.kv_outputs = KVOutputAggregator(self.world_size) if config.kv_connector != "none" else None
        self._last_step_done = 0.0  # time.monotonic() when the driver rank last answered a step
        self._started_ray = not ray.is_initialized()
        self._reaper = None
        if self._started_ray:
            ray.init(address=address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=True)
            self._reaper = start_reaper(_session_name(ray)) if address is None and "RAY_ADDRESS" not in os.environ \
                else None
        gpus = 1.0 if config.device.startswith("cuda") else 0.0
        bundle = {"CPU": num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self._pg = ray.util.placement_group([bundle] * self.world_size, strategy=placement_strategy)
        self.actors: list[Any] = []
        self._constructed: set[int] = set()  # ranks whose actor answered a ping (_check_pings)
        try:
            ray.get(self._pg.ready(), timeout=60)
            actor_cls = _actor_class(ray, num_cpus_per_worker, gpus)
            self.actors = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(
                config.to_dict(), rank, self.world_size) for rank in range(self.world_size)]
            end = time.monotonic() + self.deadlines.startup_timeout_s
            self._gather([a.ping.remote() for a in self.actors], "start-up", end)  # every actor exists
            self._constructed = set(range(self.world_size))  # from now on a silent one is lost (_check_pings)
            init_method = (self._gather([self.actors[0].rendezvous_address.remote()], "start-up", end)[0]
                           if self.world_size > 1 else None)
            self._gather([a.start.remote(init_method) for a in self.actors], "start-up", end)
        except (ray.exceptions.RayError, TimeoutError, _Lost) as exc:
            self.shutdown()
            raise WorkerError(f"executor=ray could not start its ranks: {_cause(exc)}") from None

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Ray must be installed; pipeline parallelism's refusals (``pipeline_refusals``)."""
        problems = super().validate(config) + pipeline_refusals(config)
        if importlib.util.find_spec("ray") is None:
            problems.append(f"executor=ray needs Ray, which is not installed: {INSTALL_HINT}")
        return problems

    def collective_rpc(self, method: str | Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, unique_reply_rank: int | None = None) -> list[Any]:
        """Put the call in the object store once, run it on every actor, gather (see :class:`Executor`);
        one call at a time. ``timeout_s=None``: the call's deadline (``Deadlines.for_call``)."""
        if timeout_s is None:
            timeout_s = self.deadlines.for_call(method, self.config.compile == "true")
        name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
        with self._rpc_lock:
            self._resolve_steps()  # the steps in flight first (an actor runs its calls in order anyway)
            refs = self._send(method, args, kwargs or {}, unique_reply_rank)
            results = self._collect(refs, name, time.monotonic() + timeout_s)
        return [results[unique_reply_rank]] if unique_reply_rank is not None else results

    def _send(self, method: str | Any, args: tuple, kwargs: dict[str, Any], unique_reply_rank: int | None) -> list[Any]:
        """Submit one call to every actor (each runs its calls in submission order); its object refs."""
        import ray

        if self.dead is not None:
            raise self.dead
        payload = ray.put((method, args, kwargs, unique_reply_rank))
        return [a.call.remote(payload) for a in self.actors]

    def _collect(self, refs: list[Any], name: str, end: float) -> list[Any]:
        """Every rank's result of one call (:meth:`_gather`), a lost or failed rank turned into the executor's
        verdict: ``EngineDeadError`` (dead, silent, late, or failed in ``execute_model``), else ``WorkerError``."""
        import ray

        try:
            return self._gather(refs, name, end)
        except _Lost as exc:
            raise self._lost(str(exc)) from None
        except ray.exceptions.RayActorError as exc:
            raise self._lost(f"an actor died during {name!r}: {_cause(exc)}") from None
        except ray.exceptions.RayTaskError as exc:
            if name == "execute_model":
                raise self._lost(f"a rank failed in execute_model: {_cause(exc)}") from None
            raise WorkerError(f"a rank failed in {name}: {_cause(exc)}") from None

    def _gather(self, refs: list[Any], method: str, end: float) -> list[Any]:
        """The results of ``refs`` in order; a rank that dies or raises ends the wait at once (``ray.get``
        of the list would first wait for the others, e.g. rank 0 in a collective with the dead rank).

        Raises:
            _Lost: ``end`` (``time.monotonic()`` seconds) passed, or an actor missed its ping.
            ray.exceptions.RayActorError, RayTaskError: from the first failed rank.
        """
        import ray

        pending, pings = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(_TICK_S, max(end - time.monotonic(), 0.0)))
            if ready:
                ray.get(ready)  # raises at once for a failed rank
                continue
            if time.monotonic() >= end:
                raise _Lost(f"no reply to {method!r} within its deadline ({self._deadline_hint(method)})")
            self._check_pings(pings, method)
        return ray.get(refs)

    def _check_pings(self, pings: dict[int, tuple[Any, float]], method: str) -> None:
        """Keep one ping in flight per actor (``pings``: rank -> (ref, sent at)); an answered one is
        replaced (its rank joins ``self._constructed``), one older than ``heartbeat_timeout_s`` makes the rank lost.
        During start-up the bound applies only to an actor that answered once (the executor pings every
        actor first thing, before the rendezvous and the weights): one still being constructed
        (a worker process importing Ray's runtime, which holds the GIL for seconds on a loaded host) answers
        no ping until it exists, and ``startup_timeout_s`` bounds that; one that answered and then falls
        silent (stopped while it loads weights) is lost after ``heartbeat_timeout_s``, as with ``mp``."""
        import ray

        now = time.monotonic()
        for rank, actor in enumerate(self.actors):
            limit = self.deadlines.heartbeat_timeout_s if method != "start-up" or rank in self._constructed \
                else float("inf")
            ref, sent = pings.get(rank, (None, now))
            if ref is not None:
                done, _ = ray.wait([ref], timeout=0)
                if done:
                    ray.get(done)  # a dead actor raises RayActorError
                    self._constructed.add(rank)
                elif now - sent > limit:
                    raise _Lost(f"worker rank {rank} answered no ping for {now - sent:.1f} s during {method!r} "
                                f"(executor.params.heartbeat_timeout_s={limit:g}): stopped (SIGSTOP, a debugger) "
                                "or stuck holding the GIL")
                else:
                    continue
            pings[rank] = (actor.ping.remote(), now)

    def _deadline_hint(self, method: str) -> str:
        """Which bound applied, and the knob that sets it."""
        d = self.deadlines
        if method == "start-up":
            return f"executor.params.startup_timeout_s={d.startup_timeout_s:g}"
        if method == "execute_model":
            return "the step deadline from the measured step times (executor.params.min_step_deadline_s, execute_timeout_s)"
        if d.for_call(method, self.config.compile == "true") == d.compile_timeout_s:
            return f"executor.params.compile_timeout_s={d.compile_timeout_s:g}"
        return f"executor.params.rpc_timeout_s={d.rpc_timeout_s:g}"

    @property
    def max_concurrent_batches(self) -> int:
        """``pipeline_parallel_size``: one step per stage in flight (1 without pipeline parallelism)."""
        return self.config.pipeline_parallel_size

    def _send_step(self, message: Any, scheduler_output: Any) -> Any:
        """Submit the step to every actor now (each runs it after the steps before it); the returned function
        waits for the driver rank's result under the step deadline (``StepDeadline``), counted from when the
        step before it answered. With a KV connector every rank answers and the driver rank's result carries
        every rank's worker-side report, merged (``KVOutputAggregator``, as ``executor=mp``)."""
        num_tokens = scheduler_output.total_num_scheduled_tokens
        t_sent = time.monotonic()
        reply_rank = self.driver_rank if self.kv_outputs is None else None
        refs = self._send("execute_model", (message,), {}, reply_rank)

        def collect() -> Any:
            t0 = max(t_sent, self._last_step_done)
            replies = self._collect(refs, "execute_model", t0 + self.step_deadline.deadline_s(num_tokens))
            out = (replies[self.driver_rank] if self.kv_outputs is None else
                   self.kv_outputs.merge_into(replies, self.driver_rank))
            self._last_step_done = time.monotonic()
            self.step_deadline.observe(num_tokens, self._last_step_done - t0)
            return out

        return collect

    def check_health(self) -> None:
        """Ping every actor (``heartbeat_timeout_s``); a dead or silent one makes the executor dead."""
        import ray

        if self.dead is not None:
            raise self.dead
        with self._rpc_lock:
            try:
                self._gather([a.ping.remote() for a in self.actors], "check_health",
                             time.monotonic() + self.deadlines.heartbeat_timeout_s)
            except (_Lost, ray.exceptions.RayError) as exc:
                raise self._lost(f"check_health: {_cause(exc)}") from None

    def _lost(self, reason: str) -> EngineDeadError:
        error = self._fail(EngineDeadError(f"executor=ray lost a worker: {reason}"))
        self.shutdown()
        return error

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group; stop Ray if this executor started it."""
        import ray

        if not ray.is_initialized():
            stop_reaper(getattr(self, "_reaper", None))
            self._reaper = None
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
            stop_reaper(self._reaper)
            self._reaper = None


class _Lost(Exception):
    """A rank missed its deadline or its ping (turned into ``EngineDeadError`` by the caller)."""


def _session_name(ray: Any) -> str:
    """The name of the Ray session this process started (``session_<date>_<pid>``), or "" if Ray hides it."""
    try:
        return str(ray._private.worker._global_node.session_name or "")
    except AttributeError:  # a Ray whose private layout changed: no reaper (Ray's own clean-up still runs)
        return ""


def _cause(exc: BaseException) -> str:
    """The innermost error text of a Ray exception (the rank's traceback for a task error)."""
    return str(getattr(exc, "cause", None) or exc)


@hookimpl
def register_executors(register: Register) -> None:
    """Register ``ray``."""
    register("ray", RayExecutor)
