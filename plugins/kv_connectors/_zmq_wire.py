"""The wire of ``kv_connector=zmq``: a producer's block server (a zmq ROUTER socket on its own thread, next to the
KV tensors) and a consumer's block puller (a DEALER socket per pull, on its own thread).

The decode side pulls, as vLLM's ``NixlConnector`` does (the prefill side only keeps the blocks and answers): the
puller sends ``[b"pull", json {"request_id", "block_ids"}]``; the server answers ``[b"wait"]`` (the request's blocks
are not registered yet: the consumer retries until its timeout), ``[b"error", message]``, or ``[b"data", json
header, layer frames...]`` (one frame per layer: the requested blocks gathered into one contiguous tensor, sent
zero-copy from it; the puller receives each into a staging tensor with ``recv_into`` and scatters it into its
destination blocks with ``index_copy_``). The puller then sends ``[b"done", request_id]``: the server's blocks may be freed. pyzmq is the
transport until a real one (nixl, mooncake) replaces it.

Under tensor parallelism every rank runs its own server over its own KV heads' shard, at the engine's base port plus
its rank (vLLM's ``NixlConnector``: side-channel port + ``tp_rank``; :func:`bind_rank_server` agrees on a base whose
whole run of ports is free), and consumer rank ``r`` pulls from producer rank ``r`` (:attr:`Pull.remote_tp_size`
must equal the consumer's, else the pull fails naming the fix: :func:`tp_mismatch_message`).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

logger = logging.getLogger(__name__)

_POLL_MS = 20  # how often the threads look at their stop flag and timeouts, ms


def block_dim_of(shape_1: tuple[int, ...], shape_2: tuple[int, ...]) -> int:
    """The block dimension of a cache layout, from ``backend.get_kv_cache_shape(1)`` and ``(2)``.

    Raises:
        ValueError: the two shapes differ in other than one dimension.
    """
    dims = [i for i, (a, b) in enumerate(zip(shape_1, shape_2)) if a != b]
    if len(shape_1) != len(shape_2) or len(dims) != 1:
        raise ValueError(f"kv_connector=zmq cannot find the block dimension of cache shapes {shape_1} / {shape_2}")
    return dims[0]


def block_chunks(cache: torch.Tensor, block: int, block_dim: int) -> list[torch.Tensor]:
    """The contiguous pieces of block ``block`` of one layer's ``cache`` (views, no copy), in a fixed order: one per
    index of the dimensions before ``block_dim`` (e.g. K then V for ``(2, num_blocks, block_size, heads, head_size)``).

    Raises:
        ValueError: ``cache`` is not contiguous (its blocks are not runs of memory).
    """
    if not cache.is_contiguous():
        raise ValueError("kv_connector=zmq needs contiguous KV cache tensors")
    leading = itertools.product(*map(range, cache.shape[:block_dim]))
    return [cache[idx + (block,)] for idx in leading]


def _gathered_shape(cache: torch.Tensor, num_blocks: int, block_dim: int) -> tuple[int, ...]:
    """The shape of ``num_blocks`` blocks of one layer's ``cache`` gathered along ``block_dim``."""
    return tuple(cache.shape[:block_dim]) + (num_blocks,) + tuple(cache.shape[block_dim + 1:])


def gather_blocks(caches: list[torch.Tensor], block_ids: list[int], block_dim: int) -> list[torch.Tensor]:
    """Blocks ``block_ids`` of every layer, one contiguous CPU tensor per layer (``index_select`` along
    ``block_dim``: shape :func:`_gathered_shape`, the cache's dtype): what a pull's answer sends, one frame per layer
    (a frame per block and layer cost a Python round per 32 KiB piece: 0.35 GB/s where this moves ~1 GB/s).

    Raises:
        ValueError: a cache is not contiguous.
    """
    if not all(cache.is_contiguous() for cache in caches):
        raise ValueError("kv_connector=zmq needs contiguous KV cache tensors")
    index = torch.tensor(block_ids, dtype=torch.long)
    return [cache.index_select(block_dim, index.to(cache.device)).cpu() for cache in caches]


def _as_bytes(chunk: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bfloat16 included)."""
    return memoryview(chunk.reshape(-1).view(torch.uint8).numpy())


@dataclass
class _Held:
    """A finished request's blocks that the server keeps for a pull."""

    block_ids: list[int]  # the producer's block ids, in token order
    deadline: float  # time.monotonic() after which the blocks are freed unpulled
    trackers: list[zmq.MessageTracker] = field(default_factory=list)  # zero-copy sends zmq may still read


class BlockServer:
    """The producer's side: serves pulls of held blocks on a ROUTER socket from a daemon thread.

    Args:
        caches: the rank's per-layer KV tensors (read only, by the server thread, for held blocks only).
        block_dim: the block dimension of their layout (:func:`block_dim_of`).
        host: the interface to bind (``kv_connector.params.host``).
        port: the TCP port; 0 picks a free one (:attr:`port` says which).
        abort_timeout_s: a held request not pulled within this many seconds is freed (vLLM's
            ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), s.

    Raises:
        zmq.ZMQError: the address cannot be bound (e.g. the port is taken).
    """

    def __init__(self, caches: list[torch.Tensor], block_dim: int, host: str, port: int,
                 abort_timeout_s: float) -> None:
        self._caches, self._block_dim, self._abort_timeout_s = caches, block_dim, abort_timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self._sock.close()
            self._ctx.term()
            raise
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._finished: set[str] = set()  # pulled (or timed out) since the last take_finished
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-zmq-server", daemon=True)
        self._thread.start()

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        """Keep ``block_ids`` of a finished request for a pull (called by the worker side, main thread)."""
        with self._lock:
            self._held[request_id] = _Held(list(block_ids), time.monotonic() + self._abort_timeout_s)

    def take_finished(self) -> set[str]:
        """Requests whose blocks were pulled, released or timed out since the last call: free them."""
        with self._lock:
            done, self._finished = self._finished, set()
        return done

    def close(self) -> None:
        """Stop the thread and close the socket and context; idempotent."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sock.close(linger=0)
            self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_POLL_MS):
                frames = self._sock.recv_multipart()
                try:
                    self._answer(frames)
                except Exception:  # noqa: BLE001 - one bad message must not stop the server
                    logger.exception("kv_connector=zmq: a pull failed on the producer")
            self._expire()

    def _answer(self, frames: list[bytes]) -> None:
        ident, kind, body = frames[0], frames[1], frames[2] if len(frames) > 2 else b""
        if kind == b"done":
            self._release(body.decode(), pulled=True)
            return
        msg = json.loads(body)
        rid, want = msg["request_id"], msg["block_ids"]
        with self._lock:
            held = self._held.get(rid)
        if held is None:
            self._sock.send_multipart([ident, b"wait"])
            return
        if not set(want) <= set(held.block_ids):
            self._sock.send_multipart([ident, b"error", f"blocks {sorted(set(want) - set(held.block_ids))} of "
                                       f"request {rid!r} are not held".encode()])
            return
        chunks = gather_blocks(self._caches, want, self._block_dim)
        header = json.dumps({"chunk_nbytes": [c.nbytes for c in chunks]}).encode()
        tracker = self._sock.send_multipart([ident, b"data", header] + [_as_bytes(c) for c in chunks],
                                            copy=False, track=True)
        with self._lock:
            held.trackers.append(tracker)

    def _release(self, rid: str, pulled: bool) -> None:
        with self._lock:
            held = self._held.get(rid)
            if held is None or any(not t.done for t in held.trackers):
                return  # zmq still reads the blocks: freed at a later check
            del self._held[rid]
            self._finished.add(rid)
        if not pulled:
            logger.warning("kv_connector=zmq: request %s was not pulled within abort_timeout_s=%s; its blocks are "
                           "freed", rid, self._abort_timeout_s)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, held in self._held.items() if held.deadline <= now]
        for rid in late:
            self._release(rid, pulled=False)


#: ``exchange(values)`` -> every rank's ``values`` in rank order: a collective over the TP group (every rank calls it
#: at the same point with as many ints)
Exchange = Callable[[list[int]], list[list[int]]]
BIND_ATTEMPTS = 16  # free bases rank 0 tries before giving up (another process may take a port of the run meanwhile)


def tp_group_exchange(tp_size: int, device: torch.device) -> Exchange:
    """An :data:`Exchange` over this rank's tensor-parallel group (an int64 all-gather on ``device``, the KV cache's:
    gloo and the shared-memory communicator take CPU tensors, NCCL CUDA ones); at one rank, no collective.

    Raises:
        RuntimeError: ``tp_size > 1`` and this process has no TP group of that size (a worker side of a
            ``tensor_parallel_size > 1`` engine runs in a rank, which has one).
    """
    if tp_size == 1:
        return lambda values: [list(values)]
    from framework.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size != tp_size:
        raise RuntimeError(f"kv_connector=zmq: this rank's TP group has {group.world_size} ranks, its KV shard says "
                           f"{tp_size}")

    def exchange(values: list[int]) -> list[list[int]]:
        flat = group.all_gather(torch.tensor(values, dtype=torch.int64, device=device)).tolist()
        return [flat[r * len(values):(r + 1) * len(values)] for r in range(tp_size)]

    return exchange


def _try_server(caches: list[torch.Tensor], block_dim: int, host: str, port: int,
                abort_timeout_s: float) -> BlockServer | None:
    """A server bound at ``port`` (0: a free one), or None when that port is taken (or past 65535)."""
    if port > 65535:
        return None
    try:
        return BlockServer(caches, block_dim, host, port, abort_timeout_s)
    except zmq.ZMQError:
        return None


def bind_rank_server(caches: list[torch.Tensor], block_dim: int, host: str, port: int, abort_timeout_s: float,
                     tp_rank: int, tp_size: int, exchange: Exchange) -> BlockServer:
    """This rank's :class:`BlockServer`, bound at ``base + tp_rank`` (vLLM's NIXL side channel: base port plus the
    TP rank), so that ``kv_transfer_params`` name every rank by one ``remote_port`` (the base) and ``tp_size``.

    ``port`` > 0 is the base; ``port == 0``: rank 0 binds a free port and the others try the ports after it, all
    ranks retrying with another base (up to :data:`BIND_ATTEMPTS`) until every rank bound its own. Every rank of the
    group must call this at the same point (two :data:`Exchange` rounds per attempt).

    Args:
        caches, block_dim, host, abort_timeout_s: as :class:`BlockServer`.
        port: the base port (``kv_connector.params.port``), 0 for a free run of ``tp_size`` ports.
        tp_rank, tp_size: this rank and the engine's ``tensor_parallel_size``.
        exchange: the TP group's collective (:func:`tp_group_exchange`).

    Raises:
        zmq.ZMQError: a port ``port + r`` is taken on some rank (every rank raises), or no free run was found.
    """
    for _ in range(BIND_ATTEMPTS):
        server = _try_server(caches, block_dim, host, port, abort_timeout_s) if tp_rank == 0 else None
        base = exchange([server.port if server is not None else 0])[0][0]  # rank 0's
        if tp_rank > 0 and base:
            server = _try_server(caches, block_dim, host, base + tp_rank, abort_timeout_s)
        if all(ok for (ok,) in exchange([int(server is not None)])):
            return server
        if server is not None:
            server.close()
        if port:
            raise zmq.ZMQError(zmq.EADDRINUSE, f"kv_connector=zmq: ports {port}-{port + tp_size - 1} (one per rank) "
                               f"cannot all be bound on {host}: choose a free kv_connector.params.port, or 0")
    raise zmq.ZMQError(zmq.EADDRINUSE, f"kv_connector=zmq: found no {tp_size} consecutive free ports on {host} in "
                       f"{BIND_ATTEMPTS} attempts")


def tp_mismatch_message(remote_request_id: str, remote_tp_size: int, tp_size: int) -> str:
    """Why a consumer of ``tp_size`` ranks cannot load a producer's request of ``remote_tp_size`` ranks, and the fix."""
    return (f"kv_connector=zmq: the producer of request {remote_request_id!r} runs tensor_parallel_size="
            f"{remote_tp_size} and this engine {tp_size}; each rank pulls its own KV heads' shard from the producer's "
            "rank of the same index, so both need the same parallel.tensor_parallel_size (its blocks count as failed "
            "loads: kv_transfer.load_failure_policy decides)")


@dataclass
class Pull:
    """One request's pull (plain values: it travels in the step metadata)."""

    request_id: str  # the consumer's request id
    remote_request_id: str  # the producer's request id
    remote_host: str
    remote_port: int  # the producer's base port: its rank r serves at remote_port + r
    remote_block_ids: list[int]  # the producer's blocks to read
    local_block_ids: list[int]  # where they go here, one per remote block; empty: only release the producer's
    remote_tp_size: int = 1  # the producer's tensor_parallel_size (vLLM's kv_transfer_params "tp_size")

    def rank_ports(self, tp_rank: int, tp_size: int) -> list[int]:
        """The producer ranks' ports that consumer rank ``tp_rank`` of ``tp_size`` answers for: rank ``tp_rank``'s
        alone when the sizes match; under a mismatch every ``tp_size``-th from it (to release them: each producer
        rank is released by exactly one consumer rank)."""
        return [self.remote_port + r for r in range(tp_rank, self.remote_tp_size, tp_size)]


@dataclass
class PullResult:
    """A finished pull, for the worker side's ``get_finished``."""

    request_id: str
    bad_block_ids: set[int]  # local blocks that did not arrive (all of them on a failure)
    num_bytes: int  # bytes received
    seconds: float  # wall time of the pull, s
    loaded: bool  # False for a release (the pull named no local blocks)
    error: str | None = None  # why the pull failed (naming the fix where there is one); None: it did not fail


class BlockPuller:
    """The consumer's side: runs pulls one after another on a daemon thread and collects their results.

    Args:
        caches: the rank's per-layer KV tensors (written only in the blocks a pull names).
        block_dim: the block dimension of their layout.
        timeout_s: a pull not answered in full within this many seconds fails (its blocks are bad), s.
        tp_rank, tp_size: this rank and the engine's ``tensor_parallel_size``: the puller reads from the producer's
            rank ``tp_rank`` (:meth:`Pull.rank_ports`); a producer of another size fails the pull.
    """

    def __init__(self, caches: list[torch.Tensor], block_dim: int, timeout_s: float, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self._caches, self._block_dim, self._timeout_s = caches, block_dim, timeout_s
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._ctx = zmq.Context()
        self._jobs: queue.Queue[Pull | None] = queue.Queue()
        self._lock = threading.Lock()
        self._results: list[PullResult] = []
        self._buffer: torch.Tensor | None = None  # staging bytes for one layer's pulled blocks (puller thread only)
        self._thread = threading.Thread(target=self._run, name="kv-zmq-puller", daemon=True)
        self._thread.start()
        self._closed = False

    def submit(self, pull: Pull) -> None:
        """Queue ``pull`` (main thread)."""
        self._jobs.put(pull)

    def take_results(self) -> list[PullResult]:
        """Pulls finished since the last call."""
        with self._lock:
            done, self._results = self._results, []
        return done

    def close(self) -> None:
        """Finish the queued pulls, stop the thread, close the context; idempotent."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._thread.join()
            self._ctx.term()

    def _run(self) -> None:
        while (pull := self._jobs.get()) is not None:
            start = time.monotonic()
            error = None
            try:
                num_bytes, bad = self._pull(pull), set()
            except Exception as exc:  # noqa: BLE001 - any failure is a load error of the pull's blocks
                error = (f"rank {self._tp_rank} pulling request {pull.remote_request_id} from {pull.remote_host}:"
                         f"{pull.remote_port + self._tp_rank} failed: {exc}")
                logger.warning("kv_connector=zmq: %s", error)
                num_bytes, bad = 0, set(pull.local_block_ids)
            result = PullResult(pull.request_id, bad, num_bytes, time.monotonic() - start, bool(pull.local_block_ids),
                                error)
            with self._lock:
                self._results.append(result)

    def _pull(self, pull: Pull) -> int:
        """Receive this rank's shard of ``pull``'s blocks from the producer's rank of the same index; returns the
        bytes received.

        Raises:
            TimeoutError: no full answer within ``timeout_s``.
            RuntimeError: the producer refused, its blocks do not fit this cache, or it runs another
                ``tensor_parallel_size`` (:func:`tp_mismatch_message`).
        """
        socks = []
        for port in pull.rank_ports(self._tp_rank, self._tp_size):
            socks.append(sock := self._ctx.socket(zmq.DEALER))
            sock.setsockopt(zmq.LINGER, 1000)  # the "done" must leave before the socket closes
            sock.connect(f"tcp://{pull.remote_host}:{port}")
        try:
            if not pull.local_block_ids:
                return 0
            if pull.remote_tp_size != self._tp_size:
                raise RuntimeError(tp_mismatch_message(pull.remote_request_id, pull.remote_tp_size, self._tp_size))
            return self._receive(socks[0], pull)
        finally:  # pulled, failed or not needed: the producer's ranks may free the request's blocks
            for sock in socks:
                sock.send_multipart([b"done", pull.remote_request_id.encode()])
                sock.close()

    def _receive(self, sock: zmq.Socket, pull: Pull) -> int:
        deadline = time.monotonic() + self._timeout_s
        ask = json.dumps({"request_id": pull.remote_request_id, "block_ids": pull.remote_block_ids}).encode()
        while True:
            sock.send_multipart([b"pull", ask])
            kind = self._recv_within(sock, deadline)
            if kind != b"wait":
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the producer did not hold request {pull.remote_request_id!r} within "
                                   f"pull_timeout_s={self._timeout_s}")
            time.sleep(0.01)  # the producer has not registered the request yet
        if kind == b"error":
            raise RuntimeError(f"the producer refused: {sock.recv().decode()}")
        want = json.loads(sock.recv())["chunk_nbytes"]
        index = torch.tensor(pull.local_block_ids, dtype=torch.long)
        shapes = [_gathered_shape(cache, len(index), self._block_dim) for cache in self._caches]
        have = [math.prod(shape) * cache.element_size() for shape, cache in zip(shapes, self._caches)]
        if want != have:
            raise RuntimeError(f"the producer's blocks do not fit this cache ({len(want)} layers of {want[:1]} bytes, "
                               f"this cache {len(have)} of {have[:1]}): one model, dtype, block size and attention "
                               "backend on both sides")
        for cache, shape in zip(self._caches, shapes):
            if not sock.getsockopt(zmq.RCVMORE):
                raise RuntimeError("the producer's answer ended early")
            staging = self._staging(shape, cache.dtype)  # this layer's pulled blocks, then scattered into place
            if sock.recv_into(_as_bytes(staging)) != staging.nbytes:
                raise RuntimeError("a layer's blocks have the wrong size")
            cache.index_copy_(self._block_dim, index.to(cache.device), staging.to(cache.device))
        return sum(want)

    def _staging(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A CPU tensor of ``shape`` and ``dtype`` over one byte buffer the puller keeps and grows (a fresh
        allocation per layer paid its page faults on every pull)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def _recv_within(self, sock: zmq.Socket, deadline: float) -> bytes:
        while not sock.poll(_POLL_MS, zmq.POLLIN):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer within pull_timeout_s={self._timeout_s}")
        return sock.recv()
