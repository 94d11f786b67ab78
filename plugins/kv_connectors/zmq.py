"""``kv_connector=zmq``: prefill -> decode KV transfer between engines over pyzmq; the decode side pulls.

vLLM's ``NixlConnector`` contract with pyzmq as the wire (``plugins/kv_connectors/_zmq_wire.py``; nixl or mooncake
may replace it later). A **producer** (``kv_transfer.role=kv_producer``; under ``kv_both`` only the requests whose
``kv_transfer_params`` say ``do_remote_decode``) keeps a finished request's full prompt blocks before its last
prompt token (``request_finished`` -> ``delay_free``) and hands back ``kv_transfer_params`` naming them:
``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_host``, ``remote_port``,
``remote_block_ids``, ``remote_request_id`` (vLLM's names) and ``remote_num_tokens``. Its worker side serves pulls
of those blocks on a ROUTER socket from a thread (``kv_connector.params.host`` / ``port``; port 0 picks a free
one, which the worker side reports to the scheduler side through ``get_kv_connector_kv_cache_events``), and
reports the request in ``get_finished``'s ``sending`` once the consumer acknowledged the pull, or after
``abort_timeout_s`` unpulled. A **consumer** (``kv_consumer`` or ``kv_both``) given those parameters in
``SamplingParams.kv_transfer_params`` offers the remote blocks after its local prefix hit as an asynchronous load
(``WAITING_FOR_REMOTE_KVS``); its worker side pulls them into the request's blocks on a thread and reports the
request in ``recving``; a pull that fails or outlasts ``pull_timeout_s`` reports all its blocks through
``get_block_ids_with_load_errors`` (``kv_transfer.load_failure_policy`` applies). A consumer that needs none of the
remote blocks (a local hit, a prompt shorter than one block) still tells the producer to free them.

Under tensor parallelism (``executor=mp``) each rank's worker side serves and pulls its own KV heads' shard, as
vLLM's NixlConnector does per TP rank: producer rank ``r`` serves at ``port + r`` (the ranks agree on a free base
over their TP group), every rank reports every rank's address (``("zmq_endpoint", engine_id, tp_rank, host,
port)``, identical on all ranks, so the executor's merge passes them), ``kv_transfer_params`` name the base
(``remote_port``) and ``tp_size`` (vLLM's names), and consumer rank ``r`` pulls from producer rank ``r``. A producer
of another ``tensor_parallel_size`` fails the request's load (``kv_transfer.load_failure_policy`` decides), with a
warning naming the fix; under ``fail`` the fix also reaches the request's error (``get_load_error_reasons``).
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from framework import hookimpl
from framework.core.request import RequestStatus
from framework.hookspecs import Register
from framework.interfaces import KVConnector, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole

if TYPE_CHECKING:
    import torch

    from framework.config import EngineConfig
    from framework.core.outputs import SchedulerOutput
    from framework.core.request import Request
    from framework.interfaces import AttentionBackend
    from plugins.kv_connectors._zmq_wire import BlockPuller, BlockServer, Pull, PullResult

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.001  # how long an idle step's get_finished waits for a transfer to finish, s
ENDPOINT_EVENT = "zmq_endpoint"  # ("zmq_endpoint", engine_id, tp_rank, host, port): one rank's server address


@dataclass
class ZmqMetadata(KVConnectorMetadata):
    """One step's transfers (plain values)."""

    pulls: list[Pull] = field(default_factory=list)  # consumer: pulls to start
    holds: dict[str, list[int]] = field(default_factory=dict)  # producer: request id -> its blocks to serve
    idle: bool = False  # the step schedules nothing (it only polls transfers): get_finished may wait a little


class ZmqConnector(KVConnector):
    """Prefill -> decode transfer of whole prompt blocks over zmq (both roles in one class).

    Args:
        role, block_size, kv_role: see :class:`~framework.interfaces.KVConnector`.
        host: the address the producer's servers bind and hand to consumers (``kv_connector.params.host``).
        port: the TCP port of rank 0's server; rank ``r`` binds ``port + r`` (0: a free run of ports).
        abort_timeout_s: a held request not pulled within this many seconds is freed, s (> 0).
        pull_timeout_s: a pull not answered in full within this many seconds fails, s (> 0).

    Raises:
        ValueError: a timeout <= 0 or a port outside 0-65535.
    """

    name = "zmq"

    def __init__(self, role: KVConnectorRole, block_size: int, kv_role: str = "kv_both", host: str = "127.0.0.1",
                 port: int = 0, abort_timeout_s: float = 120.0, pull_timeout_s: float = 30.0,
                 **params: Any) -> None:
        super().__init__(role, block_size, kv_role, **params)
        for what, value in (("abort_timeout_s", abort_timeout_s), ("pull_timeout_s", pull_timeout_s)):
            if not float(value) > 0:
                raise ValueError(f"kv_connector.params.{what} must be > 0 seconds, got {value!r}")
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"kv_connector.params.port must be 0 (a free port) to 65535, got {port!r}")
        self.host, self.port = host, int(port)
        self.abort_timeout_s, self.pull_timeout_s = float(abort_timeout_s), float(pull_timeout_s)
        # scheduler side
        self._servers: dict[int, tuple[str, str, int]] = {}  # tp_rank -> (engine id, host, port) of its server
        self._warned_tp: set[int] = set()  # producer tensor_parallel_size values already warned about
        self._pulls: list[Pull] = []  # queued for the next step's metadata
        self._holds: dict[str, list[int]] = {}  # likewise
        self._pulling: set[str] = set()  # consumer requests whose pull the worker side runs
        self._asked: set[str] = set()  # consumer requests whose remote blocks were queued once (never again)
        # worker side
        self._server: BlockServer | None = None
        self._puller: BlockPuller | None = None
        self._events: list[Any] = []
        self._load_errors: set[int] = set()
        self._load_error_reasons: dict[int, str] = {}  # bad block -> why its pull failed (reported with it)
        self._stats: list[tuple[int, float]] = []  # (bytes, seconds) of the pulls finished since the last report

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Also: pyzmq must be installed; every rank's port (``port + tp_rank``) at most 65535."""
        problems = super().validate(config)
        try:
            import zmq  # noqa: F401
        except ImportError:
            problems.append("kv_connector=zmq needs pyzmq: pip install pyzmq")
        port = int(config.kv_connector_params.get("port", 0) or 0)
        if port and port + config.tensor_parallel_size - 1 > 65535:
            problems.append(f"kv_connector=zmq: rank r serves at kv_connector.params.port + r, past 65535 from port "
                            f"{port} with tensor_parallel_size={config.tensor_parallel_size}: use a lower port, or 0")
        return problems

    # ---- scheduler side ----------------------------------------------------------------------------
    def _remote(self, request: Request) -> dict[str, Any] | None:
        """The producer's ``kv_transfer_params`` of a consumer request, or None."""
        params = request.sampling_params.kv_transfer_params
        if not self.is_consumer or not params or not params.get("do_remote_prefill"):
            return None
        return params

    def _num_loadable(self, request: Request, params: dict[str, Any]) -> int:
        """Remote blocks this request may load: never the block of its last prompt token."""
        return min(len(params.get("remote_block_ids") or ()), (request.num_prompt_tokens - 1) // self.block_size)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The remote blocks after the local hit, in tokens, loaded asynchronously; 0 for a request without
        ``do_remote_prefill`` or whose remote blocks were already queued (a preempted request recomputes)."""
        params = self._remote(request)
        if params is None or request.request_id in self._asked:
            return 0, False
        num_blocks = self._num_loadable(request, params) - num_computed_tokens // self.block_size
        return (num_blocks * self.block_size, True) if num_blocks > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the pull of the remote blocks after the local hit (or, loading none, a release of them all)."""
        params = self._remote(request)
        if params is None or request.request_id in self._asked:
            return
        from plugins.kv_connectors._zmq_wire import Pull

        self._asked.add(request.request_id)
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        remote = list(params.get("remote_block_ids") or ())
        if not num_external_tokens and not remote:
            return
        remote_tp_size = int(params.get("tp_size") or 1)
        if num_external_tokens and remote_tp_size != self.kv_shard.tp_size and remote_tp_size not in self._warned_tp:
            from plugins.kv_connectors._zmq_wire import tp_mismatch_message

            self._warned_tp.add(remote_tp_size)  # once per producer size; each such request's load fails
            logger.warning(tp_mismatch_message(str(params["remote_request_id"]), remote_tp_size,
                                               self.kv_shard.tp_size))
        self._pulls.append(Pull(request.request_id, str(params["remote_request_id"]), str(params["remote_host"]),
                                int(params["remote_port"]), remote[first:last], block_ids[first:last], remote_tp_size))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ZmqMetadata:
        """This step's pulls and holds; finished requests are forgotten."""
        meta = ZmqMetadata(pulls=self._pulls, holds=self._holds,
                           idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._pulling.update(p.request_id for p in self._pulls if p.local_block_ids)
        self._pulls, self._holds = [], {}
        self._asked -= set(scheduler_output.finished_req_ids)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn this engine's server addresses (one per rank); forget finished pulls."""
        for event in connector_output.kv_cache_events or ():
            if isinstance(event, (tuple, list)) and event and event[0] == ENDPOINT_EVENT:
                engine_id, tp_rank, host, port = event[1:]
                self._servers[int(tp_rank)] = (str(engine_id), str(host), int(port))
        self._pulling -= connector_output.finished_recving or set()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Producer: keep the full prompt blocks before the last prompt token for a pull and name them (nothing to
        keep: ``remote_block_ids=[]``, freed now). Consumer: a pull not yet started is cancelled (False); one in
        flight keeps the blocks until it ends (True)."""
        rid = request.request_id
        if any(p.request_id == rid for p in self._pulls):
            self._pulls = [p for p in self._pulls if p.request_id != rid]
            return False, None
        if rid in self._pulling:
            return True, None
        own = request.sampling_params.kv_transfer_params or {}
        sends = self.kv_role == "kv_producer" or (self.is_producer and own.get("do_remote_decode"))
        if not sends or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        tp_size = self.kv_shard.tp_size
        if len(self._servers) < tp_size:
            logger.warning("kv_connector=zmq: %d of %d ranks reported their server address yet; request %s is not "
                           "offered", len(self._servers), tp_size, rid)
            return False, None
        keep = block_ids[:(request.num_prompt_tokens - 1) // self.block_size]
        engine_id, host, port = self._servers[0]  # rank r serves at port + r (bind_rank_server)
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
                  "remote_host": host, "remote_port": port, "tp_size": tp_size, "remote_block_ids": list(keep),
                  "remote_request_id": rid, "remote_num_tokens": len(keep) * self.block_size}
        if keep:
            self._holds[rid] = list(keep)
        return bool(keep), params

    # ---- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        """Start the server thread (producer) and the puller thread (consumer) over the rank's caches (its shard).

        A producer under tensor parallelism agrees with the other ranks, over their TP group, on a base port (rank
        ``r`` at base + ``r``) and on rank 0's engine id, and reports every rank's address: every rank calls this at
        the same point (``Worker.initialize_cache``).

        Raises:
            ValueError: a cache layout whose blocks are not contiguous runs of memory.
            zmq.ZMQError: the server addresses cannot be bound.
            RuntimeError: ``kv_shard.tp_size > 1`` outside a rank of a TP group of that size.
        """
        from plugins.kv_connectors import _zmq_wire as wire

        block_dim = wire.block_dim_of(backend.get_kv_cache_shape(1), backend.get_kv_cache_shape(2))
        for cache in kv_caches:
            wire.block_chunks(cache, 0, block_dim)
        tp_rank, tp_size = self.kv_shard.tp_rank, self.kv_shard.tp_size
        if self.is_producer:
            exchange = wire.tp_group_exchange(tp_size, kv_caches[0].device)
            self._server = wire.bind_rank_server(list(kv_caches), block_dim, self.host, self.port,
                                                 self.abort_timeout_s, tp_rank, tp_size, exchange)
            weakref.finalize(self, self._server.close)
            ranks = exchange([self._server.port, uuid.uuid4().int >> 65])  # (port, a 63-bit engine id) per rank
            engine_id = f"{ranks[0][1]:016x}"  # rank 0's: one engine id for all its ranks
            self._events += [(ENDPOINT_EVENT, engine_id, r, self.host, port) for r, (port, _) in enumerate(ranks)]
        if self.is_consumer:
            self._puller = wire.BlockPuller(list(kv_caches), block_dim, self.pull_timeout_s, tp_rank, tp_size)
            weakref.finalize(self, self._puller.close)

    def close(self) -> None:
        """Stop the threads and close the sockets (also done when the connector is garbage-collected)."""
        for part in (self._server, self._puller):
            if part is not None:
                part.close()

    def start_load_kv(self, **kwargs: Any) -> None:
        """Hand this step's holds to the server and its pulls to the puller (both run on their threads)."""
        meta = self.connector_metadata()
        for rid, block_ids in meta.holds.items():
            self._server.hold(rid, block_ids)
        for pull in meta.pulls:
            self._puller.submit(pull)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Nothing to wait for: loads are asynchronous (reported by :meth:`get_finished`)."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Nothing to save: the producer serves its held blocks in place."""

    def wait_for_save(self) -> None:
        """Nothing to wait for (see :meth:`save_kv_layer`)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(pulled or timed-out held requests, finished pulls)``; a finished pull's bad blocks go to
        :meth:`get_block_ids_with_load_errors` in the same step. On a step that schedules nothing and finds nothing
        finished, waits up to ``IDLE_WAIT_S`` first: an engine whose only work is transfers in flight steps
        without a forward, and would otherwise spin a core against the transfer threads."""
        sending, results = self._take_finished()
        meta = self._connector_metadata
        if not sending and not results and isinstance(meta, ZmqMetadata) and meta.idle and not meta.pulls:
            time.sleep(IDLE_WAIT_S)
            sending, results = self._take_finished()
        recving = set()
        for result in results:
            if not result.loaded:
                continue  # a release: nothing arrived, nothing was parked
            self._load_errors |= result.bad_block_ids
            self._load_error_reasons.update(dict.fromkeys(result.bad_block_ids, result.error or "the pull failed"))
            if not result.bad_block_ids:  # a failed pull moved nothing worth timing
                self._stats.append((result.num_bytes, result.seconds))
            recving.add(result.request_id)
        return sending or None, recving or None

    def _take_finished(self) -> tuple[set[str], list[PullResult]]:
        sending = self._server.take_finished() if self._server is not None else set()
        return sending, self._puller.take_results() if self._puller is not None else []

    def get_kv_connector_stats(self) -> list[tuple[int, float]] | None:
        """``(bytes, seconds)`` of each pull that succeeded since the last call, or None."""
        stats, self._stats = self._stats, []
        return stats or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of the pulls reported this step that did not arrive (then forgotten)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_load_error_reasons(self) -> dict[int, str] | None:
        """Why the blocks :meth:`get_block_ids_with_load_errors` just reported failed (their pull's error, e.g. a
        producer of another ``tensor_parallel_size``, naming the fix), then forgotten; None when none failed."""
        reasons, self._load_error_reasons = self._load_error_reasons, {}
        return reasons or None

    def get_kv_connector_kv_cache_events(self) -> list[Any] | None:
        """Once: ``("zmq_endpoint", engine_id, tp_rank, host, port)`` for every rank's server (each rank reports them
        all, so the executor's merge, which passes events every rank reported, hands them to the scheduler side)."""
        events, self._events = self._events, []
        return events or None


@hookimpl
def register_kv_connectors(register: Register) -> None:
    """Register ``zmq``."""
    register("zmq", ZmqConnector)
