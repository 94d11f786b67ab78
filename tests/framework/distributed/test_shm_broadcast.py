"""The shared-memory step broadcast: every reader gets every message in order, messages larger than
the ring span chunks, a full ring blocks the writer (never overwrites), nothing of it has a name in
``/dev/shm``, and a reader learns that the writer is gone from its wake-up pipe."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path

import pytest

from framework.distributed.shm_broadcast import ShmBroadcast, WriterGoneError


def _read_all(ring: ShmBroadcast, rank: int, n: int, out: list) -> None:
    reader = ShmBroadcast.attach(ring.reader_handle(rank))
    out.extend(reader.read(timeout_s=10) for _ in range(n))
    reader.close()


def test_every_reader_gets_every_message_in_order_including_multi_chunk_ones():
    before = set(os.listdir("/dev/shm"))
    ring = ShmBroadcast(num_readers=2, chunk_bytes=64, num_chunks=4)  # 256 data bytes in all
    assert ring.segment.name is None  # a memfd: no name at any moment (Linux)
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
    mine = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith(("psm_", "sem.mp-", "servelab_"))}
    assert not any(f"/dev/shm/{n}" in Path("/proc/self/maps").read_text() for n in mine)  # none of this process


def test_a_full_ring_blocks_the_writer_until_readers_catch_up():
    ring = ShmBroadcast(num_readers=1, chunk_bytes=64, num_chunks=2)
    ring.write(1)
    ring.write(2)
    with pytest.raises(TimeoutError):
        ring.write(3, timeout_s=0.05)  # would overwrite a chunk the reader has not consumed
    reader = ShmBroadcast.attach(ring.reader_handle(0))
    assert reader.read(timeout_s=1) == 1
    ring.write(3, timeout_s=1)
    assert [reader.read(timeout_s=1), reader.read(timeout_s=1)] == [2, 3]
    with pytest.raises(TimeoutError):
        reader.read(timeout_s=0.01)
    with pytest.raises(RuntimeError):  # a dead reader ends the wait at once
        ring.write(list(range(100)), timeout_s=10, alive=lambda: False)
    reader.close()
    ring.close()


def _child(handle, conn) -> None:
    reader = ShmBroadcast.attach(handle)
    conn.send(reader.read(timeout_s=30))
    try:
        reader.read(timeout_s=30)
    except WriterGoneError:
        conn.send("writer gone")
    reader.close()


def test_a_reader_in_another_process_and_the_writers_end():
    """The segment (a memfd) and the wake-up pipe pass to a spawned reader as Process arguments; once the writer
    closes the ring, the reader's next read ends at once (end-of-file), not after its timeout."""
    ctx = mp.get_context("spawn")
    ring = ShmBroadcast(num_readers=1, ctx=ctx)
    answers, answer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(ring.reader_handle(0), answer))
    proc.start()
    answer.close()
    ring.forget_readers()
    ring.write({"step": 1, "tokens": list(range(10_000))})
    assert answers.poll(30) and answers.recv() == {"step": 1, "tokens": list(range(10_000))}
    ring.close()
    assert answers.poll(10) and answers.recv() == "writer gone"
    proc.join(30)
    assert proc.exitcode == 0


def test_a_message_torn_in_the_middle_is_fatal_for_the_reader(monkeypatch):
    """The writer published the first chunk of a two-chunk message and no more: the reader's position no
    longer matches the ring's, so it must fail loudly (``TornMessageError``), never report "no message"
    (a ``TimeoutError``, which the worker loop treats as idle, and reads misaligned chunks after)."""
    from framework.distributed import shm_broadcast
    from framework.distributed.shm_broadcast import TornMessageError
    from framework.worker import worker_proc

    monkeypatch.setattr(shm_broadcast, "REST_OF_MESSAGE_TIMEOUT_S", 0.2)
    ring = ShmBroadcast(num_readers=1, chunk_bytes=64, num_chunks=4)
    wake = ring._wake
    woken = []

    def first_chunk_only():
        if not woken:  # the writer "dies" after its first chunk
            woken.append(1)
            wake()

    monkeypatch.setattr(ring, "_wake", first_chunk_only)
    ring.write(b"x" * 100)
    reader = ShmBroadcast.attach(ring.reader_handle(0))
    with pytest.raises(TornMessageError, match="middle of a 1.*-byte message"):
        reader.read(timeout_s=1)
    assert not isinstance(TornMessageError("x"), TimeoutError)
    # the rank's loop lets it through (its process exits 1 after reporting it)
    monkeypatch.setattr(reader, "read", lambda timeout_s: (_ for _ in ()).throw(TornMessageError("torn")))
    with pytest.raises(TornMessageError):
        worker_proc.serve_calls(worker=None, reader=reader, conn=None, parent_pid=0)
    reader.close()
    ring.close()


def test_unlink_drops_the_start_up_state_and_the_mappings_keep_working():
    ring = ShmBroadcast(num_readers=1, chunk_bytes=64, num_chunks=2)
    reader = ShmBroadcast.attach(ring.reader_handle(0))
    ring.unlink()  # what the executor does once every rank attached
    ring.write("after unlink")
    assert reader.read(timeout_s=1) == "after unlink"
    assert ring.heartbeat_ages_s() == [None]  # not beaten yet
    reader.beat()
    (age,) = ring.heartbeat_ages_s()
    assert 0 <= age < 1
    reader.close()
    ring.close()  # idempotent with the earlier unlink
    ring.unlink()
