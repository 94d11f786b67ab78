"""The shared-memory step broadcast: every reader gets every message in order, messages larger than
the ring span chunks, a full ring blocks the writer (never overwrites), and the segment is unlinked."""

from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest

from framework.executor.shm_broadcast import ShmBroadcast


def _read_all(ring: ShmBroadcast, rank: int, n: int, out: list) -> None:
    reader = ShmBroadcast.attach(ring.handle, rank)
    out.extend(reader.read(timeout_s=10) for _ in range(n))
    reader.close()


def test_every_reader_gets_every_message_in_order_including_multi_chunk_ones():
    ring = ShmBroadcast(num_readers=2, chunk_bytes=64, num_chunks=4)  # 256 data bytes in all
    messages = [("small", i) for i in range(20)] + [list(range(500)), b"x" * 3000, {"k": "v" * 70}]
    got: list[list] = [[], []]
    readers = [threading.Thread(target=_read_all, args=(ring, r, len(messages), got[r])) for r in range(2)]
    for t in readers:
        t.start()
    for message in messages:
        ring.write(message, timeout_s=10)
    for t in readers:
        t.join(10)
    assert got[0] == messages and got[1] == messages
    ring.close()
    assert not (Path("/dev/shm") / ring.handle.name).exists()


def test_a_full_ring_blocks_the_writer_until_readers_catch_up():
    ring = ShmBroadcast(num_readers=1, chunk_bytes=64, num_chunks=2)
    ring.write(1)
    ring.write(2)
    with pytest.raises(TimeoutError):
        ring.write(3, timeout_s=0.05)  # would overwrite a chunk the reader has not consumed
    reader = ShmBroadcast.attach(ring.handle, 0)
    assert reader.read(timeout_s=1) == 1
    ring.write(3, timeout_s=1)
    assert [reader.read(timeout_s=1), reader.read(timeout_s=1)] == [2, 3]
    with pytest.raises(TimeoutError):
        reader.read(timeout_s=0.01)
    with pytest.raises(RuntimeError):  # a dead reader ends the wait at once
        ring.write(list(range(100)), timeout_s=10, alive=lambda: False)
    reader.close()
    ring.close()


def _child(handle, queue) -> None:
    reader = ShmBroadcast.attach(handle, 0)
    queue.put(reader.read(timeout_s=30))
    reader.close()


def test_a_reader_in_another_process():
    ctx = mp.get_context("spawn")
    ring = ShmBroadcast(num_readers=1, ctx=ctx)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(ring.handle, queue))
    proc.start()
    ring.write({"step": 1, "tokens": list(range(10_000))})
    assert queue.get(timeout=30) == {"step": 1, "tokens": list(range(10_000))}
    proc.join(30)
    assert proc.exitcode == 0
    ring.close()


def test_a_message_torn_in_the_middle_is_fatal_for_the_reader(monkeypatch):
    """The writer published the first chunk of a two-chunk message and no more: the reader's position no
    longer matches the ring's, so it must fail loudly (``TornMessageError``), never report "no message"
    (a ``TimeoutError``, which the worker loop treats as idle, and reads misaligned chunks after)."""
    from framework.executor import shm_broadcast, worker_proc
    from framework.executor.shm_broadcast import TornMessageError

    monkeypatch.setattr(shm_broadcast, "REST_OF_MESSAGE_TIMEOUT_S", 0.2)
    ring = ShmBroadcast(num_readers=1, chunk_bytes=64, num_chunks=4)
    release = ring.handle.semaphores[0].release
    released = []

    def first_chunk_only():
        if not released:  # the writer "dies" after its first chunk
            released.append(1)
            release()

    monkeypatch.setattr(ring.handle.semaphores[0], "release", first_chunk_only)
    ring.write(b"x" * 100)
    reader = ShmBroadcast.attach(ring.handle, 0)
    with pytest.raises(TornMessageError, match="middle of a 1.*-byte message"):
        reader.read(timeout_s=1)
    assert not isinstance(TornMessageError("x"), TimeoutError)
    # the rank's loop lets it through (its process exits 1 after reporting it)
    monkeypatch.setattr(reader, "read", lambda timeout_s: (_ for _ in ()).throw(TornMessageError("torn")))
    with pytest.raises(TornMessageError):
        worker_proc.serve_calls(worker=None, reader=reader, conn=None, parent_pid=0)
    reader.close()
    ring.close()


def test_unlink_removes_the_name_and_the_mappings_keep_working():
    ring = ShmBroadcast(num_readers=1, chunk_bytes=64, num_chunks=2)
    reader = ShmBroadcast.attach(ring.handle, 0)
    ring.unlink()  # what the executor does once every rank attached
    assert not (Path("/dev/shm") / ring.handle.name).exists()
    ring.write("after unlink")
    assert reader.read(timeout_s=1) == "after unlink"
    assert ring.heartbeat_ages_s() == [None]  # not beaten yet
    reader.beat()
    (age,) = ring.heartbeat_ages_s()
    assert 0 <= age < 1
    reader.close()
    ring.close()  # idempotent with the earlier unlink
    ring.unlink()
