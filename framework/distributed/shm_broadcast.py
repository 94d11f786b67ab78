"""One-writer, many-reader message ring in shared memory (vLLM's ``shm_broadcast.MessageQueue``,
nano-vllm's ``SharedMemory`` + ``Event``).

The driver pickles each message once and copies it into the next chunk(s) of a ring of
``num_chunks`` chunks; every reader (worker rank) unpickles it straight from the shared buffer.
Readers sleep on a wake-up pipe of their own (the writer writes one byte per chunk; a reader blocks in
``poll`` until a byte arrives), so an idle worker burns no CPU: on a 2-core machine spinning readers
would steal the cores the forward needs. Flow control: each reader publishes in the segment how many
chunks it has consumed; the writer reuses a chunk only once every reader is past it. A message longer
than a chunk spans consecutive chunks, so message size is unbounded while the segment's size is fixed
(``num_chunks * chunk_bytes``, 8 MiB by default).

Layout: ``num_readers`` int64 "chunks consumed" counters, ``num_readers`` int64 heartbeats (the
reader's last ``time.monotonic_ns()``, 0 before it attached: ``framework.executor.deadlines``), then
per chunk an int64 message length and ``chunk_bytes`` of data.

Lifetime: nothing of the ring has a name. The segment is a ``memfd``
(:class:`~framework.distributed.shm_segment.AnonymousSegment`; an owned name removed once every reader
attached where there is no ``memfd``) and the wake-ups are pipes, both passed to the readers as ``Process``
arguments, so no crash of any process (a SIGKILL of the whole group included, which kills the
``multiprocessing`` resource tracker too) can leave anything in ``/dev/shm``. Before, the readers slept
on named POSIX semaphores (``/dev/shm/sem.mp-*``) that only the resource tracker removed. A reader also
learns that the writer is gone without polling: its pipe reports end-of-file once no process holds the
write end (:class:`WriterGoneError`; vLLM's workers watch a "death pipe" the same way).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from framework.distributed.shm_segment import AnonymousSegment, Mapping, memory_fence

_I64 = 8
#: seconds a reader waits for the rest of a message once its first chunk arrived (the writer
#: publishes a message's chunks back to back, waiting only for room in the ring)
REST_OF_MESSAGE_TIMEOUT_S = 60.0


class TornMessageError(RuntimeError):
    """A reader got the start of a message but not its end: its position in the ring no longer
    matches the writer's, so no later message can be read. Fatal for the reader (its process exits
    loudly); the executor then declares the rank lost."""


class WriterGoneError(EOFError):
    """A reader's wake-up pipe reached end-of-file: every process that could write the ring (the driver) has
    exited or closed it, so no message will ever come."""


@dataclass
class RingHandle:
    """What reader ``rank`` needs to attach; passed as a ``Process`` argument (the segment's descriptor and the
    reader's pipe end are duplicated into the child)."""

    segment: AnonymousSegment  # the ring's memory
    num_readers: int
    chunk_bytes: int
    num_chunks: int
    wakeup: Any  # this reader's read end of its wake-up pipe (a multiprocessing Connection)
    rank: int  # the reader's index

    @property
    def name(self) -> str | None:
        """The segment's ``/dev/shm`` name while it has one (only where there is no ``memfd``), else None."""
        return self.segment.name


class ShmBroadcast:
    """The ring; construct it in the writer, hand :meth:`reader_handle` to each reader process and
    :meth:`attach` there.

    Args:
        num_readers: reader processes (each receives every message).
        chunk_bytes: data bytes per chunk.
        num_chunks: chunks in the ring.
        ctx: the multiprocessing context of the readers (``spawn``); it makes the wake-up pipes.

    Raises:
        OSError: the kernel refused the segment or the pipes (``ENOMEM``, ``EMFILE``).
    """

    def __init__(self, num_readers: int, chunk_bytes: int = 1 << 20, num_chunks: int = 8,
                 ctx: Any = None) -> None:
        ctx = ctx or mp.get_context("spawn")
        self.num_readers, self.chunk_bytes, self.num_chunks = num_readers, chunk_bytes, num_chunks
        self.segment = AnonymousSegment(2 * num_readers * _I64 + num_chunks * (_I64 + chunk_bytes))
        self._map: Mapping = self.segment.map()
        pipes = [ctx.Pipe(duplex=False) for _ in range(num_readers)]  # (read end, write end) per reader
        self._read_ends = [r for r, _ in pipes]
        self._write_ends = [w for _, w in pipes]
        self.reader_rank: int | None = None
        self._seq = 0  # chunks written (writer) or read (reader)
        self._pending = 0  # reader: wake-up bytes received and not yet used
        self._wakeup_fd = -1  # reader: its own descriptor of its pipe's read end
        self._poll: Any = None

    def reader_handle(self, rank: int) -> RingHandle:
        """What reader ``rank`` attaches with (pass it to its process before :meth:`forget_readers`)."""
        return RingHandle(self.segment, self.num_readers, self.chunk_bytes, self.num_chunks, self._read_ends[rank],
                          rank)

    def forget_readers(self) -> None:
        """Writer: close this process's copies of the readers' pipe ends once every reader process started, so
        that a reader's exit makes :meth:`write` fail at once (``EPIPE``) rather than fill its pipe."""
        for conn in self._read_ends:
            conn.close()

    @classmethod
    def attach(cls, handle: RingHandle) -> ShmBroadcast:
        """The reader side of an existing ring (in the reader's process, or a thread of the writer's: tests).

        Raises:
            FileNotFoundError: the fallback segment's name is gone already.
        """
        self = cls.__new__(cls)
        self.num_readers, self.chunk_bytes, self.num_chunks = handle.num_readers, handle.chunk_bytes, handle.num_chunks
        self.segment = handle.segment
        self._map = handle.segment.map()
        self._read_ends, self._write_ends = [], []
        self.reader_rank = handle.rank
        self._seq = self._pending = 0
        self._wakeup_fd = os.dup(handle.wakeup.fileno())  # its own: a reader in the writer's process shares the handle
        self._poll = select.poll()
        self._poll.register(self._wakeup_fd, select.POLLIN)
        if not handle.segment.owned:  # a copy passed to this process: the mapping and the dup are all it needs
            handle.segment.close()
            handle.wakeup.close()
        return self

    # ---- layout ----------------------------------------------------------------------
    def _consumed(self) -> list[int]:
        """Chunks consumed by each reader."""
        return list(self._map.buf[:self.num_readers * _I64].cast("q"))

    def _chunk(self, seq: int) -> int:
        """Byte offset of chunk ``seq % num_chunks`` (its int64 length field)."""
        return 2 * self.num_readers * _I64 + (seq % self.num_chunks) * (_I64 + self.chunk_bytes)

    # ---- heartbeats ------------------------------------------------------------------
    def beat(self) -> None:
        """Reader: publish that this reader's process is alive (any thread of it)."""
        off = (self.num_readers + self.reader_rank) * _I64
        self._map.buf[off:off + _I64].cast("q")[0] = time.monotonic_ns()

    def heartbeat_ages_s(self) -> list[float | None]:
        """Writer: seconds since each reader's last :meth:`beat` (``None``: it has not beaten yet)."""
        n = self.num_readers
        now = time.monotonic_ns()
        beats = self._map.buf[n * _I64:2 * n * _I64].cast("q")
        return [None if b == 0 else (now - b) / 1e9 for b in beats]

    # ---- writer ----------------------------------------------------------------------
    def write(self, obj: Any, timeout_s: float | None = None, alive: Callable[[], bool] | None = None) -> int:
        """Pickle ``obj`` once and publish it to every reader; returns its size in bytes.

        Blocks only while the ring is full (a reader more than ``num_chunks`` chunks behind).

        Raises:
            TimeoutError: the ring stayed full for ``timeout_s`` seconds.
            RuntimeError: ``alive()`` turned False while waiting, or a reader's pipe is closed (a reader died).
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        buf = self._map.buf
        for start in range(0, max(len(data), 1), self.chunk_bytes):
            self._wait_for_room(timeout_s, alive)
            off = self._chunk(self._seq)
            part = data[start:start + self.chunk_bytes]
            buf[off:off + _I64].cast("q")[0] = len(data)
            buf[off + _I64:off + _I64 + len(part)] = part
            memory_fence()
            self._wake()
            self._seq += 1
        return len(data)

    def _wake(self) -> None:
        """One wake-up byte to every reader (never blocks: a reader holds at most ``num_chunks`` unread)."""
        try:
            for conn in self._write_ends:
                os.write(conn.fileno(), b"\x01")
        except (BrokenPipeError, OSError) as exc:  # OSError: closed by close() on another thread
            raise RuntimeError(f"a reader of the shared-memory ring died ({exc})") from None

    def _wait_for_room(self, timeout_s: float | None, alive: Callable[[], bool] | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._seq - min(self._consumed()) >= self.num_chunks:
            if alive is not None and not alive():
                raise RuntimeError("a reader of the shared-memory ring died")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory ring full for {timeout_s} s: a reader is stuck")
            time.sleep(50e-6)

    # ---- reader ----------------------------------------------------------------------
    def _woken(self, timeout_s: float | None) -> bool:
        """Reader: take one wake-up (a chunk is ready), waiting up to ``timeout_s`` seconds (None: forever).

        Raises:
            WriterGoneError: the pipe reached end-of-file (the writer's process is gone).
        """
        if self._pending == 0:
            if not self._poll.poll(None if timeout_s is None else max(int(timeout_s * 1000), 0)):
                return False
            got = os.read(self._wakeup_fd, 4096)
            if not got:
                raise WriterGoneError(f"reader {self.reader_rank}: the ring's writer is gone")
            self._pending = len(got)
        self._pending -= 1
        return True

    def read(self, timeout_s: float | None = None) -> Any:
        """The next message (blocks until the writer publishes one).

        Raises:
            TimeoutError: nothing arrived within ``timeout_s`` seconds (nothing was consumed).
            WriterGoneError: the writer's process is gone (no message will come).
            TornMessageError: the rest of a message did not come within
                :data:`REST_OF_MESSAGE_TIMEOUT_S` (this reader is out of step for good).
        """
        buf = self._map.buf
        if not self._woken(timeout_s):
            raise TimeoutError("no message")
        off = self._chunk(self._seq)
        total = buf[off:off + _I64].cast("q")[0]
        if total <= self.chunk_bytes:  # one chunk: unpickle in place, no copy
            obj = pickle.loads(buf[off + _I64:off + _I64 + total])
            self._consumed_one()
            return obj
        data = bytearray()
        while True:
            take = min(self.chunk_bytes, total - len(data))
            data += buf[off + _I64:off + _I64 + take]
            self._consumed_one()
            if len(data) == total:
                return pickle.loads(data)
            try:
                woken = self._woken(REST_OF_MESSAGE_TIMEOUT_S)
            except WriterGoneError:
                woken = False
            if not woken:
                raise TornMessageError(f"reader {self.reader_rank}: the writer stopped in the middle of a "
                                       f"{total}-byte message ({len(data)} bytes read, nothing more for "
                                       f"{REST_OF_MESSAGE_TIMEOUT_S:.0f} s); this reader is out of step")
            off = self._chunk(self._seq)

    def _consumed_one(self) -> None:
        self._seq += 1
        memory_fence()
        self._map.buf[self.reader_rank * _I64:(self.reader_rank + 1) * _I64].cast("q")[0] = self._seq

    # ---- lifetime --------------------------------------------------------------------
    def unlink(self) -> None:
        """Writer: once every reader attached, drop what only served the start-up: the fallback segment's name
        (a memfd never had one) and this process's copies of the readers' pipe ends. The mappings stay.
        Idempotent."""
        self.segment.forget_name()
        self.forget_readers()

    def close(self) -> None:
        """Unmap the segment in this process and close its pipe ends (readers then see end-of-file); the writer
        also does :meth:`unlink` if it has not yet. Idempotent."""
        self._map.close()
        for conn in [*self._write_ends, *self._read_ends]:
            conn.close()
        if self._wakeup_fd >= 0:
            os.close(self._wakeup_fd)
            self._wakeup_fd = -1
        if self.reader_rank is None:
            self.segment.close()
