"""``AsyncLLM``: the asyncio front over one or more engine cores (vLLM V1's ``AsyncLLM``).

The front keeps one output stream per request and talks to its engine cores through clients
(:mod:`framework.engine.core_client`): the core's loop on a thread of this process (``AsyncLLM(engine)``,
``server.engine_process=false``), or engine cores in processes of their own over ZMQ (:meth:`AsyncLLM.from_clients`,
the server's default), one per data-parallel replica (``parallel.data_parallel_size=N``) with a router plugin
(``router=NAME``) choosing each request's replica from the load the cores publish with every step.
``generate`` registers the request's stream, then sends it to a core; every core event
(:class:`~framework.engine.core_messages.EngineCoreOutputs`) arrives on a client thread and is handed to each
caller's event loop with ``call_soon_threadsafe``.

Faults (issues 34, 44, 49): a request the engine refuses fails with ``ValueError``; a request the engine fails (a
plugin raised on it) ends with its own error output. A core that dies (its step raised, a hung step, its process
exited) fails every request it held with :class:`~framework.core.faults.EngineDeadError`; with other replicas alive
the router stops choosing it and they keep serving, else the front is dead: every later request fails and
``on_dead`` is called (the server then exits non-zero, as ``vllm serve`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from framework import registry
from framework.core.faults import EngineDeadError
from framework.core.lora_request import LoRARequest
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.core_client import CoreClient, InprocCoreClient
from framework.engine.core_messages import AbortRequests, AddRequest, EngineCoreOutputs, ReplicaStats
from framework.engine.replica_set import ReplicaSet
from framework.interfaces.engine import EngineClient
from framework.interfaces.router import ReplicaState

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue owned by the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput items, or an Exception (rejection / engine failure)

    def put(self, item: RequestOutput | Exception) -> bool:
        """Hand ``item`` to the caller's loop; False when that loop is closed (the caller is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed": never let a vanished caller kill the engine loop
            return False
        return True


#: what a P/D prefill asks of the KV connector (vLLM's field names, as its toy proxy and NixlConnector send them)
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None}


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The prefill phase of a P/D request (vLLM's toy proxy's prefill request): ``params`` with one output token
    (``max_tokens=1``, ``min_tokens=0``), one sequence, no logprobs or prompt logprobs, the final output only, and
    ``kv_transfer_params`` :data:`PREFILL_KV_TRANSFER_PARAMS` (over the request's own)."""
    return dataclasses.replace(params, n=1, max_tokens=1, min_tokens=0, logprobs=None, prompt_logprobs=None,
                               output_kind=RequestOutputKind.FINAL_ONLY,
                               kv_transfer_params={**(params.kv_transfer_params or {}), **PREFILL_KV_TRANSFER_PARAMS})


def _replay_hooks(event: EngineCoreOutputs) -> None:
    """A core process's lifecycle hooks, called again in this process (its plugins: a run's tracker)."""
    if event.event == "hello" and event.facts is not None:
        registry.call_hook("on_engine_start", config=event.facts.config)
    for stats in event.step_stats:
        registry.call_hook("on_step_end", stats=stats)
    for output in event.outputs:
        if output.finished:
            registry.call_hook("on_request_finished", output=output)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    """On a caller's loop: hand each output to its stream's queue."""
    for stream, output in items:
        stream.queue.put_nowait(output)


class AsyncLLM:
    """Asynchronous generation over engine cores; thread-safe, many concurrent ``generate`` calls.

    Args:
        engine: a built engine served by a core on a thread of this process (None with ``clients``); from now on
            only that thread touches it.
        on_dead: called once, on a client thread, with the fault when the front dies (every replica died),
            after every in-flight request got its ``EngineDeadError``.
        startup: (with ``engine``) run once on the core's thread before any request (a server's compile warm-up,
            ``engine.maybe_compile(None)``); requests queue meanwhile, :attr:`ready` is False and
            :attr:`startup_s` counts. An exception in it kills the engine like one in a step.
        clients: the engine cores (instead of ``engine``), one per data-parallel replica, in replica order.
        router: the router plugin choosing a replica per request (needed with several clients).
        metrics: an object with ``observe_stats(ReplicaStats)`` and ``observe_finished(RequestOutput)`` (the
            server's Prometheus metrics), fed on client threads.
        tokenizer: the model's tokenizer, for text prompts a router must see as tokens (several clients).
        roles: each client's role (``prefill``, ``decode`` or ``both``, in replica order; default all ``both``).
            With prefill replicas (``disagg.prefill_replicas``) every request runs in two phases: a prefill on a
            ``prefill`` replica (:func:`prefill_params`: one output token, the KV connector asked to keep the prompt's
            KV for a remote decode), then the request itself on a ``decode`` replica with the prefill's
            ``kv_transfer_params``; the router picks each (``Router.route_role``).

    Use :meth:`shutdown` (or ``async with``) to abort everything in flight and stop the cores.
    """

    def __init__(self, engine: EngineClient | None = None, on_dead: Callable[[BaseException], None] | None = None,
                 startup: Callable[[], Any] | None = None, *, clients: Sequence[CoreClient] | None = None,
                 router: Any = None, metrics: Any = None, tokenizer: Any = None,
                 roles: Sequence[str] | None = None) -> None:
        if (engine is None) == (clients is None):
            raise ValueError("AsyncLLM takes an engine (served in-process) or clients, not both")
        self.engine = engine
        self.clients = list(clients) if clients is not None else [InprocCoreClient(engine, startup)]
        self.on_dead, self.router, self.metrics, self.tokenizer = on_dead, router, metrics, tokenizer
        n = len(self.clients)
        # placement, liveness and the router, as the offline front keeps them (raises without a router for n > 1)
        self.replicas = ReplicaSet(n, router, roles=roles)
        self._lock = threading.RLock()  # streams, placement, replica state: generate vs client threads
        self._streams: dict[str, _Stream] = {}
        self._prefills: set[str] = set()  # ids of P/D prefill phases in flight (not the client's requests: no metrics)
        self._ids = itertools.count()
        self._ready = [False] * n
        self._stats: dict[int, ReplicaStats] = {}  # replica id -> its last publication
        self._routed_since = [0] * n  # requests routed to a client since its last publication
        self._published_s = [0.0] * n  # seconds (front clock) of each client's last publication
        self._t0 = time.monotonic()
        self._ready_at: float | None = None
        self._stopping = False
        self.errored: BaseException | None = None  # set once the front died; new requests then fail
        self.summaries: dict[int, dict[str, Any] | None] = {}  # client index -> its metrics summary at shutdown
        for client in self.clients:
            client.start(self._on_event)

    @property
    def num_routed(self) -> list[int]:
        """Requests routed to each client so far."""
        return self.replicas.num_routed

    @property
    def _alive(self) -> list[bool]:
        return self.replicas.alive

    @classmethod
    def from_clients(cls, clients: Sequence[CoreClient], **kwargs: Any) -> AsyncLLM:
        """An ``AsyncLLM`` over already-built clients (``router``, ``metrics``, ``tokenizer``, ``on_dead``)."""
        return cls(clients=clients, **kwargs)

    # ---- caller side ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Queue one request and yield its outputs as the engine produces them.

        Outputs follow ``sampling_params.output_kind`` (default here: ``DELTA``, i.e. only new
        text/tokens per output). The last output has ``finished=True``. Leaving the loop early
        (``break``, task cancellation, client disconnect) aborts the request: its blocks are
        freed at the next step boundary. ``lora_request``: the LoRA adapter it runs under (``None``: the base
        model); it travels to the engine core with the request (``AddRequest.lora_request``). With prefill
        replicas (``roles``) the request is first prefilled on one (id ``prefill-<request_id>``, its final output
        not yielded unless it failed), then runs on a decode replica with the prefill's ``kv_transfer_params``.

        Raises:
            ValueError: the engine rejected the request (bad prompt/params, duplicate id).
            NoReplicaError: (P/D) no alive replica of the phase's role.
            EngineDeadError: the engine died (before or while this request ran).
            RuntimeError: the engine loop is shut down.
        """
        params = sampling_params or SamplingParams(output_kind=RequestOutputKind.DELTA)
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        role = None
        if self.replicas.disaggregated:  # P/D: the prefill phase first (its id: prefill-<request_id>)
            with self._lock:
                if request_id in self._streams:
                    raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
            prefilled, prefill_id = None, f"prefill-{request_id}"
            with self._lock:
                self._prefills.add(prefill_id)
            try:
                async with contextlib.aclosing(self._run(prefill_id, prompt, prefill_params(params), priority,
                                                         lora_request, "prefill")) as outputs:
                    async for output in outputs:
                        prefilled = output
            finally:
                with self._lock:
                    self._prefills.discard(prefill_id)
            if prefilled.error is not None:  # the prefill failed: so does the request, with its error
                yield dataclasses.replace(prefilled, request_id=request_id)
                return
            params = dataclasses.replace(params, kv_transfer_params=prefilled.kv_transfer_params
                                         or params.kv_transfer_params)
            role = "decode"
        async with contextlib.aclosing(self._run(request_id, prompt, params, priority, lora_request, role)) as outputs:
            async for output in outputs:
                yield output

    async def _run(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
                   lora_request: LoRARequest | None, role: str | None) -> AsyncIterator[RequestOutput]:
        """One engine request on a replica of ``role`` (``None``: any): :meth:`generate`'s outputs."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # a client that dies after this sees the stream and fails it
            if self.errored is not None:
                raise self._dead_error()
            if self._stopping:
                raise RuntimeError("the engine loop is not running (shut down)")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
            index = self._route(request_id, prompt, role)
            self._streams[request_id] = stream
            self.replicas.place(request_id, index)
            self._routed_since[index] += 1
        self.clients[index].send(AddRequest(request_id, prompt, params, priority, lora_request=lora_request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (from any thread); its stream gets a final ``finish_reason="abort"`` output."""
        with self._lock:
            index = self.replicas.where.get(request_id)
        if index is not None and self._alive[index]:
            self.clients[index].send(AbortRequests([request_id]))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort every in-flight request (each stream gets its final output) and stop the cores; with
        ``timeout_s=0`` only ask them to stop (a signal handler)."""
        with self._lock:
            self._stopping = True
        for client in self.clients:
            client.shutdown(timeout_s)
        if timeout_s > 0:
            with self._lock:  # a core that could not say goodbye: its callers must not wait forever
                streams, self._streams = list(self._streams.values()), {}
                self.replicas.where.clear()
            for stream in streams:
                stream.put(RuntimeError("the engine loop is shut down"))

    @property
    def ready(self) -> bool:
        """True once every live core finished its start-up work (``startup``) and requests are served."""
        return self._ready_at is not None

    @property
    def startup_s(self) -> float:
        """Seconds the start-up work has run so far (its whole time once :attr:`ready`)."""
        return (self._ready_at if self._ready_at is not None else time.monotonic()) - self._t0

    @property
    def is_running(self) -> bool:
        """True while a core serves and the front is not shutting down."""
        return not self._stopping and self.errored is None and any(self._alive)

    def replica_alive(self) -> list[bool]:
        """Per data-parallel replica (in replica order), whether it still serves (from the cores' publications)."""
        with self._lock:
            if self._stats:
                return [self._stats[k].alive and self._alive[self._client_of(k)] for k in sorted(self._stats)]
            return list(self._alive)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.to_thread(self.shutdown)

    # ---- routing ---------------------------------------------------------------------
    def _route(self, request_id: str, prompt: str | list[int], role: str | None = None) -> int:
        """The client index for a new request (under the lock): the router's choice among live replicas (of
        ``role``, when given)."""
        if len(self.clients) == 1:
            return 0
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer(prompt).input_ids) if self.tokenizer is not None else []
        else:
            token_ids = list(prompt)
        return self.replicas.choose(request_id, token_ids, [self._replica_state(i) for i in range(len(self.clients))],
                                    role)

    def _replica_state(self, index: int) -> ReplicaState:
        """Client ``index``'s load as routers see it: its last publication plus what was routed since."""
        stats = self._stats.get(self.clients[index].replica_id)
        if stats is None:
            return ReplicaState(index, num_waiting_reqs=self._routed_since[index], alive=self._alive[index])
        return ReplicaState(index, num_waiting_reqs=stats.num_waiting_reqs + self._routed_since[index],
                            num_running_reqs=stats.num_running_reqs, kv_cache_usage=stats.kv_cache_usage,
                            alive=self._alive[index] and stats.alive, published_s=self._published_s[index])

    def _client_of(self, replica_id: int) -> int:
        for i, client in enumerate(self.clients):
            if client.replica_id == replica_id:
                return i
        return 0  # an in-process data-parallel front: one client, several replica ids

    # ---- client threads ---------------------------------------------------------------
    def _on_event(self, replica_id: int, event: EngineCoreOutputs) -> None:
        """Every event batch of a core (see the module docstring)."""
        index = self._client_of(replica_id)
        if self.clients[index].replays_hooks:
            _replay_hooks(event)
        with self._lock:
            self._apply_stats(index, event.stats)
            for rejected in event.rejected:
                stream = self._pop(rejected.request_id)
                if stream is not None:
                    stream.put(EngineDeadError(rejected.message) if rejected.engine_dead
                               else ValueError(rejected.message))
            batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
            for output in event.outputs:
                self._dispatch(index, output, batches)
            for loop, items in batches.items():  # one wake-up of each caller loop per step, not one per request
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # "Event loop is closed": those callers are gone, stop computing for them
                    for _stream, output in items:
                        if not output.finished and self._pop(output.request_id) is not None:
                            self.clients[index].send(AbortRequests([output.request_id]))
            if event.event == "ready":
                self._ready[index] = True
                if self._ready_at is None and all(r or not a for r, a in zip(self._ready, self._alive)):
                    self._ready_at = time.monotonic()
            elif event.event == "stopped":
                self.summaries[index] = event.summary
                self._alive[index] = False
            elif event.event in ("dead", "failed") and self._alive[index]:
                self._replica_died(index, event.message or event.event)

    def _apply_stats(self, index: int, stats: list[ReplicaStats]) -> None:
        if not stats:
            return
        self._published_s[index] = time.monotonic() - self._t0
        self._routed_since[index] = 0
        for item in stats:
            if len(self.clients) > 1:  # the front counts what it routed; an in-process front counts its own
                item = msgspec.structs.replace(item, num_routed=self.num_routed[index])
            self._stats[item.replica_id] = item
            if self.metrics is not None:
                self.metrics.observe_stats(item)

    def _pop(self, request_id: str) -> _Stream | None:
        """Forget a request that ended (the router is told); its stream, if its caller still waits."""
        self.replicas.finish(request_id)
        return self._streams.pop(request_id, None)

    def _dispatch(self, index: int, output: RequestOutput,
                  batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]]) -> None:
        """Bookkeeping of one output (under the lock); its delivery joins its caller loop's batch."""
        stream = self._streams.get(output.request_id)
        if output.finished:
            self._pop(output.request_id)
            if self.metrics is not None and output.request_id not in self._prefills:  # a P/D request counts once
                self.metrics.observe_finished(output)
        if stream is not None:
            batches.setdefault(stream.loop, []).append((stream, output))

    def _replica_died(self, index: int, message: str) -> None:
        """Client ``index``'s core died: fail its requests; the front dies with its last replica."""
        stopping_or_last = self._stopping or len(self.replicas.live()) <= 1
        held = self.replicas.remove(index, message) if not stopping_or_last else []
        self._alive[index] = False
        for replica_id, stats in list(self._stats.items()):  # its last word: gone (routers, /metrics, /health)
            if self._client_of(replica_id) == index:
                routed = self.num_routed[index] if len(self.clients) > 1 else stats.num_routed
                self._stats[replica_id] = msgspec.structs.replace(stats, alive=False, num_routed=routed)
                if self.metrics is not None:
                    self.metrics.observe_stats(self._stats[replica_id])
        if not stopping_or_last:  # others serve: only this replica's requests fail, retryable
            for request_id in held:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream.put(EngineDeadError(self.replicas.died_error(index, message)))
            return
        if self._stopping and not any(self._alive):
            return
        core = getattr(self.clients[index], "core", None)  # in-process: the exception itself
        self.errored = getattr(core, "dead", None) or EngineDeadError(message)
        streams, self._streams = list(self._streams.values()), {}
        self.replicas.where.clear()
        logger.error("the engine died (%s): every in-flight request fails with EngineDeadError", message)
        for stream in streams:
            stream.put(self._dead_error())
        if self.on_dead is not None:
            self.on_dead(self.errored)

    def _dead_error(self) -> EngineDeadError:
        exc = self.errored
        error = EngineDeadError(f"the engine died ({type(exc).__name__}: {exc}); its state is unknown, every "
                                "in-flight request failed; restart the engine (the server exits for its supervisor "
                                "to restart it)")
        error.__cause__ = exc
        return error
