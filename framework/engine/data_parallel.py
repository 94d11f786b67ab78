"""Data-parallel replicas behind one front (``parallel.data_parallel_size=N``, ``router=NAME``).

:class:`DataParallelEngine` owns N :class:`~framework.engine.llm_engine.LLMEngine` replicas, each with its own
scheduler, KV cache and executor (so each may be tensor-parallel), and a router plugin
(``framework.interfaces.Router``). It has the engine's interface (``add_request``, ``step``,
``abort_request``...), so ``LLM``, the offline runner and ``AsyncLLM`` drive it as they drive one engine.

* **Routing.** ``add_request`` tokenizes once, asks the router for a replica given every replica's
  :class:`~framework.interfaces.router.ReplicaState` (read from the replica's scheduler at that moment: the
  in-process replicas publish their load continuously), and queues the request there; the router learns of its
  finish (``on_request_finished``).
* **Stepping.** On the wall clock with replicas whose ranks run outside this process (``executor=mp``, which
  ``executor=auto`` picks for CPU replicas, or ``ray``), ``step`` steps every busy replica at once, each on a thread
  of its own: a replica's step waits on its worker processes with the GIL released, so the replicas compute
  concurrently, each on its own cores (:func:`build_data_parallel_engine` pins each replica's workers to
  ``parallel_state.replica_cpus``, as the server pins its engine-core processes). Otherwise ``step`` steps one busy
  replica: the one whose clock reads earliest (``executor=sim``'s virtual clocks: a discrete-event loop over
  simulated replicas, each advancing by its own predicted step times), or, on the wall clock with in-process ranks
  (``uniproc``, which cannot compute concurrently in one process), the one stepped least recently.
* **Failures.** A replica whose step raises is dead: its in-flight requests end with the error
  (``finish_reason="abort"``, ``error`` set), the router is told (``on_replica_removed``) and never sees it alive
  again, the others keep serving. Only when every replica is dead does ``step`` raise ``EngineDeadError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from framework import registry
from framework.compilation.policy import CompileDecision
from framework.config import EngineConfig
from framework.core.clock import Clock
from framework.core.faults import EngineDeadError
from framework.core.lora_request import LoRARequest
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import SamplingParams
from framework.distributed.parallel_state import replica_cpus
from framework.engine.builder import build_llm_engine
from framework.engine.dp_metrics import DataParallelMetrics
from framework.engine.llm_engine import LLMEngine
from framework.engine.replica_set import ReplicaSet
from framework.interfaces.engine import ReplicaView
from framework.interfaces.router import ReplicaState, Router
from framework.metrics.collector import MetricsCollector

logger = logging.getLogger(__name__)


class DataParallelClock(Clock):
    """The front's time over its replicas' clocks: the earliest clock of a busy replica (every replica has
    simulated at least that far), else the latest reading of any replica. Sleeping moves every idle replica's
    clock. With wall-clock replicas it is the wall clock."""

    def __init__(self, engine: DataParallelEngine) -> None:
        # weak: the engine holds this clock, and a cycle would keep every replica's KV cache after `del llm`
        self._engine_ref = weakref.ref(engine)
        self.realtime = all(r.clock.realtime for r in engine.replicas)

    @property
    def _engine(self) -> DataParallelEngine:
        engine = self._engine_ref()
        if engine is None:
            raise RuntimeError("the DataParallelEngine of this clock was garbage-collected")
        return engine

    def now(self) -> float:
        """Seconds: see the class docstring."""
        replicas = self._engine.live_replicas() or self._engine.replicas
        busy = [r.clock.now() for r in replicas if r.has_unfinished_requests()]
        return min(busy) if busy else max(r.clock.now() for r in replicas)

    def sleep_until(self, t_s: float) -> None:
        """Idle every idle replica until ``t_s`` (a virtual clock jumps; the wall clock sleeps once)."""
        if self.realtime:
            self._engine.replicas[0].clock.sleep_until(t_s)
            return
        for replica in self._engine.replicas:
            if not replica.has_unfinished_requests():
                replica.clock.sleep_until(t_s)


class DataParallelEngine:
    """N engine replicas and a router behind the engine interface (see the module docstring).

    Args:
        config: the front's config (``data_parallel_size`` = ``len(replicas)``, ``router``, ``router_params``).
        replicas: built engines, one per replica, in ``replica_id`` order.
        router: the router plugin instance.
        metrics: the front's collector (every finished request across replicas); the replicas keep their own.
    """

    def __init__(self, config: EngineConfig, replicas: list[LLMEngine], router: Router,
                 metrics: MetricsCollector) -> None:
        self.config = config
        self.replicas = replicas
        self.router = router
        self.replica_set = ReplicaSet(len(replicas), router, config.router)  # placement, liveness, the router
        self._last_stepped = [0] * len(replicas)
        self._num_steps = 0
        first = replicas[0]
        self.tokenizer, self.vocab_size, self.eos_token_ids = first.tokenizer, first.vocab_size, first.eos_token_ids
        self.max_model_len, self.structured_output = first.max_model_len, first.structured_output
        self.clock = DataParallelClock(self)
        # step the busy replicas at once: their ranks compute in worker processes (the driver waits, GIL released)
        self.concurrent = self.clock.realtime and all(r.executor.driver_model() is None for r in replicas)
        self._pool = ThreadPoolExecutor(len(replicas), "servelab-dp") if self.concurrent and len(replicas) > 1 else None
        metrics.clock = self.clock
        metrics.run_labels = first.metrics.run_labels
        self.metrics = DataParallelMetrics(metrics, replicas, self.replica_set, config.router)

    # ---- state ------------------------------------------------------------------------
    @property
    def compile_decision(self) -> CompileDecision:
        """The first live replica's ``engine.compile`` decision (each replica decides for its share)."""
        return (self.live_replicas() or self.replicas)[0].compile_decision

    @property
    def alive(self) -> list[bool]:
        """Per replica, whether it still serves."""
        return self.replica_set.alive

    @property
    def num_routed(self) -> list[int]:
        """Requests routed to each replica so far."""
        return self.replica_set.num_routed

    def live_replicas(self) -> list[LLMEngine]:
        """The replicas still serving, in ``replica_id`` order."""
        return [r for r, ok in zip(self.replicas, self.alive) if ok]

    def replica_views(self) -> list[ReplicaView]:
        """Every replica (``EngineClient.replica_views``): its engine, whether it serves, requests routed to it."""
        return [ReplicaView(r, self.alive[i], self.num_routed[i]) for i, r in enumerate(self.replicas)]

    def replica_states(self) -> list[ReplicaState]:
        """Every replica's load now (dead ones with ``alive=False``), as routers see it."""
        now = self.clock.now()
        return [dataclasses.replace(r.replica_state(i), alive=self.alive[i], published_s=now)
                for i, r in enumerate(self.replicas)]

    @property
    def num_steps(self) -> int:
        """Steps taken over all replicas."""
        return self._num_steps

    def has_unfinished_requests(self) -> bool:
        """True while any live replica has a waiting or running request."""
        return any(r.has_unfinished_requests() for r in self.live_replicas())

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, client_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Route one request and queue it on the chosen replica (``LLMEngine.add_request``'s arguments).

        Raises:
            ValueError: a bad prompt or params (nothing is routed), or a duplicate ``request_id``.
            EngineDeadError: every replica is dead.
            RuntimeError: the router chose a dead replica (a router bug).
        """
        live = self.live_replicas()
        if not live:
            raise EngineDeadError("every data-parallel replica is dead; build a new engine")
        if request_id in self.replica_set.where:
            raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
        token_ids = live[0].tokenize(prompt)  # rejects a bad prompt before any router history changes
        choice = self.replica_set.choose(request_id, token_ids, self.replica_states())
        replica = self.replicas[choice]
        if arrival_time is not None and not replica.has_unfinished_requests():
            replica.clock.sleep_until(arrival_time)  # an idle simulated replica catches up with the arrival
        try:
            replica.add_request(request_id, prompt, sampling_params, priority=priority, arrival_time=arrival_time,
                                client_id=client_id, lora_request=lora_request)
        except Exception:
            self.replica_set.refused(request_id, choice)
            raise
        self.replica_set.place(request_id, choice)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort requests wherever they run; returns their final outputs (unknown ids are ignored)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        outputs: list[RequestOutput] = []
        for i, replica in enumerate(self.replicas):
            mine = [rid for rid in ids if self.replica_set.where.get(rid) == i]
            if mine and self.alive[i]:
                outputs += replica.abort_request(mine)
        self._finished(outputs)
        return outputs

    def step(self) -> list[RequestOutput]:
        """Step every busy replica at once, or one of them (see the module docstring); a replica that fails is
        removed and its in-flight requests come back finished with its error.

        Raises:
            EngineDeadError: the last live replica died (``outputs`` holds the step's outputs, its requests' final
                ones among them).
        """
        busy = [i for i, r in enumerate(self.replicas) if self.alive[i] and r.has_unfinished_requests()]
        if not busy:
            return []
        if self._pool is None or len(busy) == 1:
            busy = [min(busy, key=lambda k: (0.0 if self.clock.realtime else self.replicas[k].clock.now(),
                                             self._last_stepped[k]))]
        for i in busy:
            self._num_steps += 1
            self._last_stepped[i] = self._num_steps
        if len(busy) == 1:
            results = [self._step_replica(busy[0])]
        else:
            results = list(self._pool.map(self._step_replica, busy))
        outputs: list[RequestOutput] = []
        for i, (stepped, exc) in zip(busy, results):
            outputs += stepped if exc is None else self._remove(i, exc)
        self._finished(outputs)
        if not any(self.alive):
            error = EngineDeadError(f"every data-parallel replica is dead (the last: replica {busy[-1]})")
            error.outputs = outputs
            raise error
        return outputs

    def _step_replica(self, i: int) -> tuple[list[RequestOutput], Exception | None]:
        """Replica ``i``'s step: its outputs, or the exception it raised (its state is then unknown: the caller
        removes it, on the caller's thread)."""
        try:
            return self.replicas[i].step(), None
        except Exception as exc:  # noqa: BLE001 - the replica is dead, the others go on
            return [], exc

    def _remove(self, i: int, exc: BaseException) -> list[RequestOutput]:
        """Mark replica ``i`` dead after its step raised ``exc``; returns its in-flight requests' final outputs."""
        reason = f"{type(exc).__name__}: {exc}"
        held = self.replica_set.remove(i, reason)
        replica = self.replicas[i]
        outputs = list(getattr(exc, "outputs", None) or [])  # an engine that saw its executor die failed them
        if replica.has_unfinished_requests():  # any other fault (or one seen by check_health): fail them here
            outputs += replica.fail_unfinished(self.replica_set.died_error(i, reason))
        try:
            replica.shutdown()
        except Exception:  # noqa: BLE001 - the original fault is what matters
            logger.exception("shutting down dead replica %d failed", i)
        for output in outputs:  # the server's fault, not the request's (HTTP 500, not 400)
            output.internal_error = True
        for output in outputs:  # metrics of the requests it held (the replica set forgot where they ran)
            if output.finished and output.request_id in held:
                self.metrics.front.observe_finished(output)
        return outputs

    def _finished(self, outputs: list[RequestOutput]) -> None:
        """Bookkeeping for finished outputs: forget where they ran, tell the router, record their metrics."""
        for output in outputs:
            if output.finished and self.replica_set.finish(output.request_id) is not None:
                self.metrics.front.observe_finished(output)

    # ---- engine interface ------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (``LLMEngine.tokenize``)."""
        return self.replicas[0].tokenize(prompt)

    def maybe_compile(self, planned_budgets: Sequence[int] | None, repeats: int = 1) -> CompileDecision:
        """``LLMEngine.maybe_compile`` on every live replica, each with its share of the planned work (the
        output-token budgets dealt round-robin, as a balanced router spreads requests); returns the first
        replica's decision."""
        live = self.live_replicas()
        n = max(len(live), 1)
        decisions = [r.maybe_compile(None if planned_budgets is None else list(planned_budgets)[i::n], repeats)
                     for i, r in enumerate(live)]
        return decisions[0] if decisions else self.replicas[0].compile_decision

    def check_health(self) -> None:
        """Remove replicas that lost a worker while idle; raise ``EngineDeadError`` when none is left."""
        for i, replica in enumerate(self.replicas):
            if self.alive[i]:
                try:
                    replica.check_health()
                except EngineDeadError as exc:
                    self._finished(self._remove(i, exc))
        if not any(self.alive):
            raise EngineDeadError("every data-parallel replica is dead; build a new engine")

    def shutdown(self) -> None:
        """Shut every replica down; idempotent."""
        for replica in self.replicas:
            replica.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def build_data_parallel_engine(config: EngineConfig, metrics: MetricsCollector | None = None,
                               defer_compile: bool = False) -> DataParallelEngine:
    """Build ``config.data_parallel_size`` replicas (each ``build_llm_engine`` of the config with
    ``data_parallel_size=1``) and the router ``config.router`` (seeded with ``config.seed``).

    Raises:
        ValueError: ``disagg.prefill_replicas > 0`` (P/D replicas are served by engine-core processes only).
        as ``build_llm_engine``; replicas already built are shut down when a later one fails.
    """
    if config.disagg_prefill_replicas and config.executor != "sim":
        raise ValueError("disagg.prefill_replicas splits a server's engine-core processes into prefill and decode "
                         "replicas (servelab serve, server.engine_process=true); offline (LLM, run.py) and "
                         "in-process replicas serve whole requests: drop disagg.prefill_replicas or serve it")
    metrics = metrics or MetricsCollector()
    router = registry.create("router", config.router, seed=config.seed, **config.plugin_params("router"))
    one = dataclasses.replace(config, data_parallel_size=1)
    n = config.data_parallel_size
    pinned = one.executor == "mp" and one.device.startswith("cpu")  # each replica's workers on its own cores
    replicas: list[LLMEngine] = []
    try:
        for i in range(n):
            with _pinned(replica_cpus(i, n) if pinned else None):
                replicas.append(build_llm_engine(one, MetricsCollector(slo_ttft_ms=metrics.slo_ttft_ms,
                                                                   slo_tpot_ms=metrics.slo_tpot_ms,
                                                                   max_records=metrics.max_records),
                                             defer_compile=defer_compile))
    except BaseException:
        for replica in replicas:
            replica.shutdown()
        raise
    front = dataclasses.replace(replicas[0].config, data_parallel_size=config.data_parallel_size)
    logger.info("data parallel: %d replicas, router=%s%s", len(replicas), config.router,
                f", each replica's ranks in worker processes on CPUs {[list(replica_cpus(i, n)) for i in range(n)]}"
                if pinned else "")
    return DataParallelEngine(front, replicas, router, metrics)


@contextlib.contextmanager
def _pinned(cpus: tuple[int, ...] | None) -> Iterator[None]:
    """Run the block with the calling thread's CPU affinity set to ``cpus`` (``None``: unchanged), restored after:
    the worker processes a replica's executor starts meanwhile inherit it, and their ranks split those cores
    among themselves (``parallel.num_threads_per_rank=0``)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
