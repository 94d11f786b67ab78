"""One-writer, many-reader message ring in POSIX shared memory (vLLM's ``shm_broadcast.MessageQueue``,
nano-vllm's ``SharedMemory`` + ``Event``).

The driver pickles each message once and copies it into the next chunk(s) of a ring of
``num_chunks`` chunks; every reader (worker rank) unpickles it straight from the shared buffer.
Readers sleep on a per-reader ``multiprocessing.Semaphore`` (one release per chunk written), so an
idle worker burns no CPU: on a 2-core machine spinning readers would steal the cores the forward
needs. Flow control: each reader publishes in the segment how many chunks it has consumed; the
writer reuses a chunk only once every reader is past it. A message longer than a chunk spans
consecutive chunks, so message size is unbounded while the segment's size is fixed
(``num_chunks * chunk_bytes``, 8 MiB by default).

Layout: ``num_readers`` int64 "chunks consumed" counters, ``num_readers`` int64 heartbeats (the
reader's last ``time.monotonic_ns()``, 0 before it attached: ``framework.executor.deadlines``), then
per chunk an int64 message length and ``chunk_bytes`` of data.

Lifetime: the writer :meth:`ShmBroadcast.unlink`\ s the name as soon as every reader attached (the
executor does it when each rank reported ``attached``), so even a SIGKILL of the whole process group
leaves nothing in ``/dev/shm``; the mappings live on until each process unmaps or exits. Readers
attach untracked (``attach_shared_memory``): only the writer's resource tracker knows the segment.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from framework.distributed.shm_communicator import attach_shared_memory, memory_fence

_I64 = 8
#: seconds a reader waits for the rest of a message once its first chunk arrived (the writer
#: publishes a message's chunks back to back, waiting only for room in the ring)
REST_OF_MESSAGE_TIMEOUT_S = 60.0


class TornMessageError(RuntimeError):
    """A reader got the start of a message but not its end: its position in the ring no longer
    matches the writer's, so no later message can be read. Fatal for the reader (its process exits
    loudly); the executor then declares the rank lost."""


@dataclass
class RingHandle:
    """What a reader process needs to attach (passed as a ``Process`` argument, so the semaphores
    are inherited)."""

    name: str  # shared-memory segment name (under /dev/shm)
    num_readers: int
    chunk_bytes: int
    num_chunks: int
    semaphores: list[Any]  # one multiprocessing.Semaphore per reader


class ShmBroadcast:
    """The ring; construct it in the writer, :meth:`attach` in each reader.

    Args:
        num_readers: reader processes (each receives every message).
        chunk_bytes: data bytes per chunk.
        num_chunks: chunks in the ring.
        ctx: the multiprocessing context of the readers (``spawn``).
    """

    def __init__(self, num_readers: int, chunk_bytes: int = 1 << 20, num_chunks: int = 8,
                 ctx: Any = None) -> None:
        ctx = ctx or mp.get_context("spawn")
        size = 2 * num_readers * _I64 + num_chunks * (_I64 + chunk_bytes)
        self.shm = SharedMemory(create=True, size=size)
        self.shm.buf[:2 * num_readers * _I64] = bytes(2 * num_readers * _I64)
        self.handle = RingHandle(self.shm.name, num_readers, chunk_bytes, num_chunks,
                                 [ctx.Semaphore(0) for _ in range(num_readers)])
        self.reader_rank: int | None = None
        self._seq = 0  # chunks written (writer) or read (reader)
        self._owner = True  # the name still exists and this process removes it

    @classmethod
    def attach(cls, handle: RingHandle, reader_rank: int) -> ShmBroadcast:
        """The reader side of an existing ring (in the reader's process)."""
        self = cls.__new__(cls)
        self.shm = attach_shared_memory(handle.name)
        self.handle = handle
        self.reader_rank = reader_rank
        self._seq = 0
        self._owner = False
        return self

    # ---- layout ----------------------------------------------------------------------
    def _consumed(self) -> list[int]:
        """Chunks consumed by each reader."""
        return list(self.shm.buf[:self.handle.num_readers * _I64].cast("q"))

    def _chunk(self, seq: int) -> int:
        """Byte offset of chunk ``seq % num_chunks`` (its int64 length field)."""
        h = self.handle
        return 2 * h.num_readers * _I64 + (seq % h.num_chunks) * (_I64 + h.chunk_bytes)

    # ---- heartbeats ------------------------------------------------------------------
    def beat(self) -> None:
        """Reader: publish that this reader's process is alive (any thread of it)."""
        off = (self.handle.num_readers + self.reader_rank) * _I64
        self.shm.buf[off:off + _I64].cast("q")[0] = time.monotonic_ns()

    def heartbeat_ages_s(self) -> list[float | None]:
        """Writer: seconds since each reader's last :meth:`beat` (``None``: it has not beaten yet)."""
        n = self.handle.num_readers
        now = time.monotonic_ns()
        beats = self.shm.buf[n * _I64:2 * n * _I64].cast("q")
        return [None if b == 0 else (now - b) / 1e9 for b in beats]

    # ---- writer ----------------------------------------------------------------------
    def write(self, obj: Any, timeout_s: float | None = None, alive: Callable[[], bool] | None = None) -> int:
        """Pickle ``obj`` once and publish it to every reader; returns its size in bytes.

        Blocks only while the ring is full (a reader more than ``num_chunks`` chunks behind).

        Raises:
            TimeoutError: the ring stayed full for ``timeout_s`` seconds.
            RuntimeError: ``alive()`` turned False while waiting (a reader died).
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        h, buf = self.handle, self.shm.buf
        for start in range(0, max(len(data), 1), h.chunk_bytes):
            self._wait_for_room(timeout_s, alive)
            off = self._chunk(self._seq)
            part = data[start:start + h.chunk_bytes]
            buf[off:off + _I64].cast("q")[0] = len(data)
            buf[off + _I64:off + _I64 + len(part)] = part
            memory_fence()
            for semaphore in h.semaphores:
                semaphore.release()
            self._seq += 1
        return len(data)

    def _wait_for_room(self, timeout_s: float | None, alive: Callable[[], bool] | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._seq - min(self._consumed()) >= self.handle.num_chunks:
            if alive is not None and not alive():
                raise RuntimeError("a reader of the shared-memory ring died")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory ring full for {timeout_s} s: a reader is stuck")
            time.sleep(50e-6)

    # ---- reader ----------------------------------------------------------------------
    def read(self, timeout_s: float | None = None) -> Any:
        """The next message (blocks until the writer publishes one).

        Raises:
            TimeoutError: nothing arrived within ``timeout_s`` seconds (nothing was consumed).
            TornMessageError: the rest of a message did not come within
                :data:`REST_OF_MESSAGE_TIMEOUT_S` (this reader is out of step for good).
        """
        h, buf = self.handle, self.shm.buf
        semaphore = h.semaphores[self.reader_rank]
        if not semaphore.acquire(timeout=timeout_s):
            raise TimeoutError("no message")
        off = self._chunk(self._seq)
        total = buf[off:off + _I64].cast("q")[0]
        if total <= h.chunk_bytes:  # one chunk: unpickle in place, no copy
            obj = pickle.loads(buf[off + _I64:off + _I64 + total])
            self._consumed_one()
            return obj
        data = bytearray()
        while True:
            take = min(h.chunk_bytes, total - len(data))
            data += buf[off + _I64:off + _I64 + take]
            self._consumed_one()
            if len(data) == total:
                return pickle.loads(data)
            if not semaphore.acquire(timeout=REST_OF_MESSAGE_TIMEOUT_S):
                raise TornMessageError(f"reader {self.reader_rank}: the writer stopped in the middle of a "
                                       f"{total}-byte message ({len(data)} bytes read, nothing more for "
                                       f"{REST_OF_MESSAGE_TIMEOUT_S:.0f} s); this reader is out of step")
            off = self._chunk(self._seq)

    def _consumed_one(self) -> None:
        self._seq += 1
        memory_fence()
        self.shm.buf[self.reader_rank * _I64:(self.reader_rank + 1) * _I64].cast("q")[0] = self._seq

    # ---- lifetime --------------------------------------------------------------------
    def unlink(self) -> None:
        """Writer: remove the name (``/dev/shm/<name>``) once every reader attached; the mappings stay.
        Idempotent."""
        if self._owner:
            self._owner = False
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap the segment in this process; the writer also unlinks it if it has not yet."""
        try:
            self.shm.close()
        except BufferError:  # a memoryview still alive in this process: the mapping goes with it
            pass
        self.unlink()
