"""A worker rank in its own process (vLLM's ``WorkerProc``): the driver-side handle and the process loop.

The driver spawns one process per rank (``multiprocessing`` spawn context). Each builds its
:class:`framework.worker.worker.Worker` (device, model shard, attention backend), reports
``ready`` (or its traceback) over its pipe, then loops: read the next call from the shared-memory
broadcast, run ``Worker.<method>``, answer over its pipe when it is a replying rank. Every rank
reads every call (they run the same forward); only the reply rank answers ``execute_model``, but
any rank reports an error. A rank exits on ``shutdown``, and on its own when the driver process
is gone (checked every second), so a killed driver leaves no worker behind.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any

from framework.executor.shm_broadcast import RingHandle, ShmBroadcast

SHUTDOWN = "shutdown"  # the method name that ends the loop
_POLL_S = 1.0  # seconds between checks that the driver still lives


def send(conn: Connection, kind: str, payload: Any) -> None:
    """One reply over a worker's pipe: ``(kind, payload)`` pickled with the standard pickler (tensors
    travel by value, never as shared-memory handles)."""
    conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> tuple[str, Any]:
    """The next ``(kind, payload)`` from a worker's pipe: ``("ready", pid)``, ``("ok", result)`` or
    ``("error", (method, traceback))``."""
    return pickle.loads(conn.recv_bytes())


def worker_main(config: dict[str, Any], rank: int, world_size: int, init_method: str | None,
                ring: RingHandle, conn: Connection, parent_pid: int) -> None:
    """Process entry point of one rank (runs in the spawned process).

    Args:
        config: ``EngineConfig.to_dict()`` (plain values).
        rank, world_size, init_method: the rank's place in ``torch.distributed``.
        ring: the driver's broadcast ring, attached as reader ``rank``.
        conn: this rank's pipe to the driver (ready/ok/error messages).
        parent_pid: the driver's pid; the loop exits when it is no longer our parent.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver handles it
    from framework.config import EngineConfig
    from framework.worker.worker import Worker

    try:
        worker = Worker(EngineConfig(**config), rank, world_size, init_method, own_process=True)
        worker.init_device()
        worker.load_model()
        reader = ShmBroadcast.attach(ring, rank)
    except BaseException:  # noqa: BLE001 - bad weights, out of memory, device...: reported to the driver
        send(conn, "error", ("start-up", traceback.format_exc()))
        return
    send(conn, "ready", os.getpid())
    try:
        _loop(worker, reader, conn, parent_pid)
    finally:
        worker.shutdown()
        reader.close()


def _loop(worker: Any, reader: ShmBroadcast, conn: Connection, parent_pid: int) -> None:
    """Serve calls until ``shutdown`` or the driver's death."""
    while True:
        try:
            method, args, kwargs, reply_rank = reader.read(timeout_s=_POLL_S)
        except TimeoutError:
            if os.getppid() != parent_pid:
                return  # the driver died without shutting us down
            continue
        if method == SHUTDOWN:
            return
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - reported; the driver decides whether the executor survives
            send(conn, "error", (method, traceback.format_exc()))
            continue
        if reply_rank is None or reply_rank == worker.rank:
            send(conn, "ok", result)
