"""The tiers of ``kv_connector=offload``, model-free: a CPU memory tier over an optional disk tier, keyed by block
prefix key, each LRU with an exact byte limit (LMCache's local CPU and local disk backends; vLLM's
``OffloadingConnector`` CPU tier).

A block is a list of CPU tensors (one per layer). The tiers are exclusive: a key lives in one tier at most. A block
put into a full CPU tier evicts the CPU tier's least recently used blocks, which spill to the disk tier (when there
is one) or are dropped; a full disk tier drops its least recently used blocks. Reading a block refreshes it; a disk
hit is promoted back to the CPU tier by the caller (:meth:`TieredBlockStore.put` after the step's loads). Bytes are
the tensors' ``nbytes`` in both tiers: a disk file holds the block's raw bytes and nothing else, so the folder's
size is what the index counts. Disk writes run on a background thread; a block being written is read from its
pending CPU copy. Disk reads run on the caller's thread (:meth:`TieredBlockStore.get`) or on a background reader
thread (:meth:`TieredBlockStore.locate`, then :meth:`TieredBlockStore.read_async`).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

Block = list[torch.Tensor]  # one CPU tensor per layer


def block_nbytes(block: Block) -> int:
    """Bytes of ``block``: the sum of its tensors' ``nbytes``."""
    return sum(t.nbytes for t in block)


class _DiskWriter:
    """One background thread writing blocks to files (temporary name, then a rename); ``pending`` holds each
    block until its file is complete. The thread and the folder go away at :meth:`close` or garbage collection."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.pending: dict[str, Block] = {}
        self.lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, Block] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-offload-disk", daemon=True)
        self._thread.start()
        self.wanted = lambda key: True  # set by the store: is ``key`` still in the disk tier?

    def file(self, key: str) -> Path:
        """The file of block ``key`` (raw bytes of its tensors, in layer order)."""
        return self.folder / f"{key}.kv"

    def submit(self, key: str, block: Block) -> None:
        """Queue ``block``'s write; it is readable from ``pending`` until its file is complete."""
        with self.lock:
            self.pending[key] = block
        self._queue.put((key, block))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: str, block: Block) -> None:
        tmp = self.folder / f".{key}.tmp"
        try:
            torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in block]).numpy().tofile(tmp)
            os.replace(tmp, self.file(key))
        except OSError as exc:  # the block stays readable from pending until it is dropped
            logger.warning("kv_connector=offload: writing block %s to %s failed: %s", key, self.folder, exc)
            tmp.unlink(missing_ok=True)
            return
        with self.lock:
            if self.pending.get(key) is block:
                del self.pending[key]
            if not self.wanted(key):  # dropped or promoted while it was being written
                self.file(key).unlink(missing_ok=True)

    def flush(self) -> None:
        """Block until every submitted write is done (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Stop the thread after the queued writes and remove the folder."""
        self._queue.put(None)
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)


class TieredBlockStore:
    """CPU tier over an optional disk tier, LRU each, byte-limited (see the module docstring).

    Args:
        cpu_bytes: the CPU tier's limit, bytes (0: no CPU tier; blocks go straight to disk).
        disk_path: a folder for the disk tier; this store writes under a fresh subfolder of it, removed at
            :meth:`close` (None: no disk tier).
        disk_bytes: the disk tier's limit, bytes.
        layout: ``(shape, dtype)`` of each layer's tensor of one block (a disk file is read back into it).

    Attributes:
        events: ``("stored", key)`` / ``("removed", key)`` since the last :meth:`take_events`, for the scheduler side,
            and the tier moves ``("disk", key)`` (spilled to, or stored straight on, disk) / ``("cpu", key)``
            (promoted back to the CPU tier).

    Raises:
        ValueError: a negative limit, or ``disk_bytes`` without ``disk_path``.
    """

    def __init__(self, cpu_bytes: int, disk_path: str | None, disk_bytes: int,
                 layout: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        if cpu_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"offload tiers need limits >= 0 bytes, got cpu_bytes={cpu_bytes} disk_bytes={disk_bytes}")
        if disk_bytes and not disk_path:
            raise ValueError("kv_connector=offload: disk_bytes needs kv_connector.params.disk_path (a folder)")
        self.cpu_bytes, self.disk_bytes, self.layout = cpu_bytes, disk_bytes if disk_path else 0, layout
        self.cpu: OrderedDict[str, Block] = OrderedDict()  # least recently used first
        self.disk: OrderedDict[str, int] = OrderedDict()  # key -> nbytes, least recently used first
        self.cpu_used = self.disk_used = 0  # bytes
        self.events: list[tuple[str, str]] = []
        self._warned = False
        self._writer: _DiskWriter | None = None
        self._reader: ThreadPoolExecutor | None = None
        if disk_path:
            Path(disk_path).mkdir(parents=True, exist_ok=True)
            self._writer = _DiskWriter(Path(tempfile.mkdtemp(prefix="servelab-offload-", dir=disk_path)))
            self._writer.wanted = self.disk.__contains__
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload-disk-read")
            self._finalizer = weakref.finalize(self, _close, self._writer, self._reader)

    @property
    def disk_folder(self) -> Path | None:
        """The folder holding this store's disk files (None without a disk tier)."""
        return None if self._writer is None else self._writer.folder

    def __contains__(self, key: str) -> bool:
        return key in self.cpu or key in self.disk

    def take_events(self) -> list[tuple[str, str]]:
        """The events since the last call (then forgotten)."""
        events, self.events = self.events, []
        return events

    def get(self, key: str) -> tuple[Block, bool] | None:
        """``(block, from_disk)`` for ``key``, refreshed in its tier's LRU order; None when absent.

        Raises:
            OSError, ValueError: the disk file is unreadable or of the wrong size.
        """
        found = self.locate(key)
        if found is None:
            return None
        where, from_disk = found
        return (self.read_file(*where) if isinstance(where, tuple) else where), from_disk

    def locate(self, key: str) -> tuple[Block | tuple[Path, int], bool] | None:
        """Where ``key``'s block is, refreshed in its tier's LRU order: ``(block, from_disk)`` when it is in memory
        (the CPU tier, or a disk write still pending), ``((file, nbytes), True)`` when it must be read from disk
        (:meth:`read_file`, :meth:`read_async`); None when absent. No disk I/O."""
        if key in self.cpu:
            self.cpu.move_to_end(key)
            return self.cpu[key], False
        if key not in self.disk:
            return None
        self.disk.move_to_end(key)
        with self._writer.lock:
            pending = self._writer.pending.get(key)
        return (pending, True) if pending is not None else ((self._writer.file(key), self.disk[key]), True)

    def read_file(self, path: Path, nbytes: int) -> Block:
        """The block in file ``path`` (``nbytes`` raw bytes in :attr:`layout`); any thread.

        Raises:
            OSError, ValueError: the file is unreadable (e.g. dropped from the tier since) or of the wrong size.
        """
        raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        if raw.numel() != nbytes:
            raise ValueError(f"file {path.name} holds {raw.numel()} bytes, expected {nbytes}")
        block, offset = [], 0
        for shape, dtype in self.layout:
            n = torch.empty(shape, dtype=dtype).nbytes
            block.append(raw[offset:offset + n].view(dtype).view(shape).clone())
            offset += n
        return block

    def read_async(self, path: Path, nbytes: int) -> Future[Block]:
        """:meth:`read_file` on the background reader thread (one, in submission order)."""
        return self._reader.submit(self.read_file, path, nbytes)

    def put(self, key: str, block: Block) -> None:
        """Store ``block`` under ``key`` in the CPU tier (most recently used), spilling the CPU tier's LRU blocks
        to disk; a key on disk moves up (promotion); a block larger than the CPU tier goes to disk; a block
        larger than both is not stored (logged once)."""
        nbytes = block_nbytes(block)
        if key in self.cpu:
            self.cpu.move_to_end(key)
            return
        was_stored = key in self.disk
        if nbytes > self.cpu_bytes:
            if was_stored:
                self.disk.move_to_end(key)
            elif nbytes <= self.disk_bytes:
                self._spill(key, block)
                self.events.append(("stored", key))
            elif not self._warned:
                self._warned = True
                logger.warning("kv_connector=offload: a block of %d bytes is larger than both tiers (cpu_bytes=%d, "
                               "disk_bytes=%d): blocks are not stored", nbytes, self.cpu_bytes, self.disk_bytes)
            return
        if was_stored:
            self._drop_disk(key)
            self.events.append(("cpu", key))
        while self.cpu_used + nbytes > self.cpu_bytes:
            old_key, old = self.cpu.popitem(last=False)
            self.cpu_used -= block_nbytes(old)
            if block_nbytes(old) <= self.disk_bytes:
                self._spill(old_key, old)
            else:
                self.events.append(("removed", old_key))
        self.cpu[key] = block
        self.cpu_used += nbytes
        if not was_stored:
            self.events.append(("stored", key))

    def _spill(self, key: str, block: Block) -> None:
        """Put ``block`` into the disk tier (most recently used), dropping the disk tier's LRU blocks to fit."""
        nbytes = block_nbytes(block)
        while self.disk_used + nbytes > self.disk_bytes:
            old_key = next(iter(self.disk))
            self._drop_disk(old_key)
            self.events.append(("removed", old_key))
        self.disk[key] = nbytes
        self.disk_used += nbytes
        self.events.append(("disk", key))
        self._writer.submit(key, block)

    def _drop_disk(self, key: str) -> None:
        with self._writer.lock:
            self.disk_used -= self.disk.pop(key)
            if self._writer.pending.pop(key, None) is None:  # written: remove the file (else the writer will)
                self._writer.file(key).unlink(missing_ok=True)

    def flush(self) -> None:
        """Block until every disk write submitted so far is complete."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Stop the disk reader and writer and remove this store's folder (also done at garbage collection)."""
        if self._writer is not None:
            self._finalizer()


def _close(writer: _DiskWriter, reader: ThreadPoolExecutor) -> None:
    """Stop ``reader`` (its queued reads are dropped) and ``writer`` (after its queued writes)."""
    reader.shutdown(wait=True, cancel_futures=True)
    writer.close()
