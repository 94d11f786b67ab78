"""``EngineCore``: the loop that owns an engine's scheduler, KV cache and executor (vLLM V1's ``EngineCore``).

One thread runs :meth:`EngineCore.run`: it steps while requests are pending and blocks on its command queue when
idle. Commands (:mod:`framework.engine.core_messages`: add, abort, shutdown) are drained between steps, so engine
state is touched by that thread only and new requests join the running batch at the next step boundary. Every
step's outputs, the requests it refused and the load after the step leave through ``emit`` as one
:class:`~framework.engine.core_messages.EngineCoreOutputs`. The same loop runs on a thread of the API process
(``server.engine_process=false``, :class:`~framework.engine.core_client.InprocCoreClient`) and in a process of its
own (:mod:`framework.engine.core_proc`), where ``emit`` feeds the ZMQ output socket.

Faults (issues 34, 44): an exception escaping ``engine.step()`` leaves the engine's state unknown, so the loop stops
and emits ``dead``; a step running longer than ``engine.watchdog_timeout_s`` (a hook that never returns) is reported
by a watchdog thread, which logs the loop thread's stack and emits ``dead`` the same way (SGLang's
``watchdog_timeout``). A request the engine refuses (bad prompt or params) is emitted as rejected, nothing else.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from framework.core.faults import EngineDeadError
from framework.core.outputs import RequestOutput
from framework.engine.core_messages import (
    RECENT_KV_TRANSFERS,
    AbortRequests,
    AddRequest,
    CoreCommand,
    EngineCoreOutputs,
    EngineFacts,
    RejectedRequest,
    ReplicaStats,
    Shutdown,
)
from framework.engine.watchdog import StepWatchdog
from framework.interfaces.engine import EngineClient, ReplicaEngine

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # seconds the idle loop blocks on the command queue before re-checking shutdown and health


def replica_stats(engine: EngineClient, replica_id: int = 0) -> list[ReplicaStats]:
    """The load and counters of ``engine`` now: one entry per replica behind it (``engine.replica_views()``: one
    for an ``LLMEngine``, one per replica of a ``DataParallelEngine``), numbered from ``replica_id``."""
    return [_one_replica(view.engine, replica_id + i, view.alive, view.num_routed)
            for i, view in enumerate(engine.replica_views())]


def _one_replica(engine: ReplicaEngine, replica_id: int, alive: bool, num_routed: int) -> ReplicaStats:
    state = engine.replica_state(replica_id)
    kv = engine.kv_allocator.stats()
    running_loras, waiting_loras = engine.lora_adapters()
    return ReplicaStats(replica_id=replica_id, alive=alive, num_running_reqs=state.num_running_reqs,
                        num_waiting_reqs=state.num_waiting_reqs, kv_cache_usage=state.kv_cache_usage,
                        prefix_queries_tokens=kv.prefix_queries_tokens, prefix_hits_tokens=kv.prefix_hits_tokens,
                        num_generated_tokens=engine.metrics.num_generated_tokens,
                        num_preemptions=engine.metrics.num_preemptions, num_routed=num_routed,
                        external_prefix_queries_tokens=engine.metrics.external_prefix_cache["external_prefix_cache_queries"],
                        external_prefix_hits_tokens=engine.metrics.external_prefix_cache["external_prefix_cache_hits"],
                        running_lora_adapters=running_loras, waiting_lora_adapters=waiting_loras,
                        **_spec_counters(engine.metrics), **_kv_transfers(engine.metrics))


def _kv_transfers(metrics: Any) -> dict[str, Any]:
    """A collector's KV connector transfers as :class:`ReplicaStats` fields: the total and the last
    ``RECENT_KV_TRANSFERS`` ``(bytes, seconds)`` records, oldest first (empty without transfers)."""
    total = metrics.kv_transfer_totals["num_kv_transfers"]
    if not total:
        return {}
    records = metrics.kv_transfers
    recent = list(itertools.islice(reversed(records), RECENT_KV_TRANSFERS))[::-1]
    return {"num_kv_transfers": total, "recent_kv_transfers": [(float(b), float(t)) for b, t in recent]}


def _spec_counters(metrics: Any) -> dict[str, Any]:
    """A collector's speculative-decoding totals as :class:`ReplicaStats` fields (zeros without speculation)."""
    return {"spec_num_drafts": metrics.spec["num_spec_reqs"], "spec_num_draft_tokens": metrics.spec["num_draft_tokens"],
            "spec_num_accepted_tokens": metrics.spec["num_accepted_tokens"],
            "spec_accepted_per_pos": [accepted for _, accepted in metrics.spec_positions]}


def engine_facts(engine: EngineClient) -> EngineFacts:
    """The ``hello`` facts of a built engine (what the front needs: lengths, vocabulary, grammar support)."""
    return EngineFacts(max_model_len=int(engine.max_model_len), vocab_size=int(engine.vocab_size),
                       eos_token_ids=sorted(int(t) for t in engine.eos_token_ids),
                       supports_structured_outputs=engine.structured_output is not None,
                       realtime_clock=bool(engine.clock.realtime),
                       config=engine.config.to_dict())


class EngineCore:
    """Runs one engine's schedule -> execute -> update loop over a command queue (see the module docstring).

    Args:
        engine: a built ``LLMEngine`` or ``DataParallelEngine``; from now on only :meth:`run`'s thread touches it.
        emit: called with every batch of events, on the loop thread (the watchdog's for a hung step); must not
            block for long.
        startup: run once on the loop thread before any request (a server's compile warm-up); commands queue
            meanwhile; ``ready`` is emitted after it. An exception in it kills the core like one in a step.
        replica_id: the first replica id this core's stats carry (its data-parallel rank).
        step_stats: returns (and forgets) the ``on_step_end`` stats seen since its previous call; they ride on
            the next event (a core process forwards its lifecycle hooks this way).
    """

    def __init__(self, engine: EngineClient, emit: Callable[[EngineCoreOutputs], None],
                 startup: Callable[[], Any] | None = None, replica_id: int = 0,
                 step_stats: Callable[[], list[Any]] | None = None) -> None:
        self.engine, self.emit, self.replica_id = engine, emit, replica_id
        self._step_stats = step_stats
        self._startup = startup
        self._commands: queue.Queue = queue.Queue()
        self._in_flight: set[str] = set()  # request ids added and not yet finished (loop thread)
        self._stopping = threading.Event()
        self._dead_lock = threading.Lock()
        self.dead: BaseException | None = None
        self._watchdog = StepWatchdog(float(engine.config.watchdog_timeout_s), self._hung)

    def put(self, command: CoreCommand) -> None:
        """Queue a command (any thread); :class:`Shutdown` also makes the loop stop after its current step."""
        if isinstance(command, Shutdown):
            self._stopping.set()
        self._commands.put(command)

    def run(self) -> None:
        """The loop: start-up work, ``ready``, then step while busy until :class:`Shutdown` or death; returns
        after emitting ``stopped`` (with the metrics summary) or ``dead``."""
        try:
            if self._startup is not None:
                self._startup()
            self.emit(EngineCoreOutputs(event="ready", stats=replica_stats(self.engine, self.replica_id)))
            while not self._stopping.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain(block=not busy)
                if not busy:  # a worker lost while idle kills the loop too (so /health turns 503)
                    self.engine.check_health()
                if self.engine.has_unfinished_requests() and not self._stopping.is_set():
                    with self._watchdog.step():
                        outputs = self.engine.step()
                    if self.dead is not None:  # the watchdog gave up on this step meanwhile
                        return
                    self._emit_outputs(outputs)
        except BaseException as exc:  # noqa: BLE001 - reported to the front, which fails every request
            logger.exception("engine core died: every in-flight request fails with EngineDeadError")
            self._die(exc)
            return
        finally:
            self._watchdog.close()
        self._drain(block=False)
        self._emit_outputs(self.engine.abort_request(sorted(self._in_flight)))
        self.emit(EngineCoreOutputs(event="stopped", summary=self._summary()))

    # ---- loop thread -------------------------------------------------------------------
    def _summary(self) -> dict[str, Any] | None:
        try:
            return self.engine.metrics.summary()
        except Exception:  # noqa: BLE001 - a summary is a courtesy at shutdown
            logger.exception("the engine's metrics summary failed")
            return None

    def _emit_outputs(self, outputs: list[RequestOutput], rejected: list[RejectedRequest] | None = None) -> None:
        for output in outputs:
            if output.finished:
                self._in_flight.discard(output.request_id)
        if outputs or rejected:
            self.emit(EngineCoreOutputs(outputs=outputs, rejected=rejected or [],
                                        stats=replica_stats(self.engine, self.replica_id),
                                        step_stats=self._step_stats() if self._step_stats is not None else []))

    def _drain(self, block: bool) -> None:
        """Apply queued commands; when ``block``, wait (idle) for the first one."""
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        outputs: list[RequestOutput] = []
        rejected: list[RejectedRequest] = []
        while True:
            if isinstance(command, AddRequest):
                refusal = self._add(command)
                if refusal is not None:
                    rejected.append(refusal)
            elif isinstance(command, AbortRequests):
                outputs += self.engine.abort_request(command.request_ids)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._emit_outputs(outputs, rejected)

    def _add(self, command: AddRequest) -> RejectedRequest | None:
        request_id = command.request_id
        if request_id in self._in_flight:
            return RejectedRequest(request_id, f"request_id {request_id!r} is already in use; use a unique id")
        try:
            self.engine.add_request(request_id, command.prompt, command.sampling_params,
                                    priority=command.priority, arrival_time=command.arrival_time,
                                    lora_request=command.lora_request)
        except EngineDeadError as exc:  # the engine's fault, not the request's: 503, not 400
            return RejectedRequest(request_id, str(exc), engine_dead=True)
        except Exception as exc:  # noqa: BLE001 - add_request changes nothing before it raises
            if isinstance(exc, ValueError):
                return RejectedRequest(request_id, str(exc))
            logger.exception("add_request(%r) raised; the request is rejected", request_id)
            return RejectedRequest(request_id, f"request rejected: {type(exc).__name__}: {exc}")
        self._in_flight.add(request_id)
        return None

    def _die(self, exc: BaseException) -> None:
        """Emit ``dead`` once (from the loop thread or the watchdog's)."""
        with self._dead_lock:
            if self.dead is not None:
                return
            self.dead = exc
        self._stopping.set()
        self.emit(EngineCoreOutputs(event="dead", message=f"{type(exc).__name__}: {exc}",
                                    error_type=type(exc).__name__))

    def _hung(self, seconds: float, stack: str) -> None:
        """The watchdog's verdict on a step past ``engine.watchdog_timeout_s``: log where it hangs, die."""
        limit = self._watchdog.timeout_s
        logger.error("engine step running for %.0f s (engine.watchdog_timeout_s=%g): hung; the loop thread is at:\n%s",
                     seconds, limit, stack)
        self._die(TimeoutError(f"an engine step made no progress for {limit:g} s (engine.watchdog_timeout_s); "
                               "a plugin hook or the forward hangs (its stack is in the log)"))
