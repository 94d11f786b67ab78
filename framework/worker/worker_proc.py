"""A worker rank in its own process (vLLM's ``WorkerProc``): the driver-side handle and the process loop.

The driver starts one process per rank (``framework.distributed.process_start``: forked from a fork server, or spawned). Each first arms its
parent-death signal (:mod:`framework.distributed.child_process`), attaches the shared-memory broadcast and
starts its heartbeat thread (``attached``), builds its :class:`framework.worker.worker.Worker` (device, model shard, attention
backend), reports ``ready`` (or its traceback) over its pipe, then loops: read the next call from the
broadcast, run it, answer over its pipe when it is a replying rank. Every rank reads every call
(they run the same forward); only the reply rank answers ``execute_model``, but any rank reports an
error. A rank exits on ``shutdown``. When the driver dies, the rank goes with it at any moment: the
kernel kills it (``PR_SET_PDEATHSIG``, Linux, a driver that started it from its main thread), its
heartbeat thread ends the process within :data:`HEARTBEAT_INTERVAL_S`
(even while it loads weights or compiles), and its ring reader sees its wake-up pipe close; a reply it
cannot send to a dead driver ends it quietly (:data:`EXIT_DRIVER_GONE`). A torn message in the ring
(:class:`~framework.distributed.shm_broadcast.TornMessageError`) is fatal: the rank reports it and exits 1.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from framework.distributed.child_process import (
    EXIT_PARENT_GONE,
    arm_parent_death_signal,
    avoid_named_semaphores,
    set_process_name,
)
from framework.distributed.shm_broadcast import RingHandle, ShmBroadcast, TornMessageError, WriterGoneError

#: seconds between two heartbeats of a rank process (``framework.executor.deadlines`` bounds their absence)
HEARTBEAT_INTERVAL_S = 0.5
SHUTDOWN = "shutdown"  # the method name that ends the loop
RING = "the step broadcast"  # what failed when a rank reports a torn message
_POLL_S = 1.0  # seconds a read waits before checking again that the driver lives
EXIT_DRIVER_GONE = EXIT_PARENT_GONE  # exit code of a rank whose driver died


def send(conn: Connection, kind: str, payload: Any) -> None:
    """One reply over a worker's pipe: ``(kind, payload)`` pickled with the standard pickler (tensors
    travel by value, never as shared-memory handles)."""
    conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> tuple[str, Any]:
    """The next ``(kind, payload)`` from a worker's pipe: ``("attached", pid)``, ``("ready", pid)``,
    ``("ok", result)`` or ``("error", (method, traceback))``."""
    return pickle.loads(conn.recv_bytes())


def run_method(worker: Any, method: str | Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``Worker.<method>(*args, **kwargs)``, or ``method(worker, *args, **kwargs)`` for a callable
    (vLLM's ``collective_rpc`` contract; it travels by reference, so it must be importable in the rank)."""
    if callable(method):
        return method(worker, *args, **kwargs)
    return getattr(worker, method)(*args, **kwargs)


class Heartbeat:
    """Beats into the ring every :data:`HEARTBEAT_INTERVAL_S` from a daemon thread and exits the process
    (code :data:`EXIT_DRIVER_GONE`) as soon as the driver is no longer its parent; :meth:`stop` before the
    ring is unmapped."""

    def __init__(self, reader: ShmBroadcast, parent_pid: int) -> None:
        self._reader, self._parent_pid = reader, parent_pid
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="servelab-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if os.getppid() != self._parent_pid:
                os._exit(EXIT_DRIVER_GONE)  # nothing to clean: nothing of the ring has a name
            self._reader.beat()
            self._stopped.wait(HEARTBEAT_INTERVAL_S)

    def stop(self) -> None:
        """End the thread (waits for a beat in progress)."""
        self._stopped.set()
        self._thread.join(5.0)


def worker_main(config: dict[str, Any], rank: int, world_size: int, init_method: str | None,
                ring: RingHandle, conn: Connection, parent_pid: int, started_by_main_thread: bool = False) -> None:
    """Process entry point of one rank (runs in the spawned process).

    Args:
        config: ``EngineConfig.to_dict()`` (plain values).
        rank, world_size, init_method: the rank's place in ``torch.distributed``.
        ring: the driver's broadcast ring, this rank's reader handle.
        conn: this rank's pipe to the driver (attached/ready/ok/error messages).
        parent_pid: the driver's pid; the process exits when it is no longer our parent.
        started_by_main_thread: the driver started us from its main thread (arms ``PR_SET_PDEATHSIG``).

    The process is named ``servelab-rank<rank>`` (``ps``, ``/proc/<pid>/comm``).
    """
    if started_by_main_thread:
        arm_parent_death_signal()  # first: the kernel kills us with the driver, even mid-compile
    set_process_name(f"servelab-rank{rank}")
    if os.getppid() != parent_pid:
        os._exit(EXIT_DRIVER_GONE)  # the driver died before the signal was armed
    avoid_named_semaphores()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the driver handles it
    try:
        _run_rank(config, rank, world_size, init_method, ring, conn, parent_pid)
    except (BrokenPipeError, ConnectionResetError, WriterGoneError):
        if os.getppid() == parent_pid:
            raise
        os._exit(EXIT_DRIVER_GONE)  # the driver is gone: nobody to tell, no traceback for its terminal


def _run_rank(config: dict[str, Any], rank: int, world_size: int, init_method: str | None, ring: RingHandle,
              conn: Connection, parent_pid: int) -> None:
    """Attach, build the worker, serve calls (see :func:`worker_main`)."""
    try:
        reader = ShmBroadcast.attach(ring)
    except BaseException:  # noqa: BLE001 - reported to the driver
        send(conn, "error", ("start-up", traceback.format_exc()))
        return
    heartbeat = Heartbeat(reader, parent_pid)
    send(conn, "attached", os.getpid())
    from framework.config import EngineConfig
    from framework.worker.worker import Worker

    try:
        worker = Worker(EngineConfig(**config), rank, world_size, init_method, own_process=True)
        worker.init_device()
        worker.load_model()
    except BaseException:  # noqa: BLE001 - bad weights, out of memory, device...: reported to the driver
        send(conn, "error", ("start-up", traceback.format_exc()))
        heartbeat.stop()
        return
    send(conn, "ready", os.getpid())
    try:
        serve_calls(worker, reader, conn, parent_pid)
    except TornMessageError:
        send(conn, "error", (RING, traceback.format_exc()))
        raise  # exit code 1, the traceback on stderr
    finally:
        worker.shutdown()
        heartbeat.stop()
        reader.close()


def serve_calls(worker: Any, reader: ShmBroadcast, conn: Connection, parent_pid: int) -> None:
    """Serve calls until ``shutdown`` or the driver's death.

    Raises:
        TornMessageError: the ring lost a message's end (this rank is out of step for good).
    """
    while True:
        try:
            method, args, kwargs, reply_rank = reader.read(timeout_s=_POLL_S)
        except TimeoutError:  # nothing arrived (a torn message is a TornMessageError, and propagates)
            if os.getppid() != parent_pid:
                return  # the driver died without shutting us down
            continue
        except WriterGoneError:
            return  # every write end of our wake-up pipe closed: the driver is gone
        if method == SHUTDOWN:
            return
        try:
            result = run_method(worker, method, args, kwargs)
        except BaseException:  # noqa: BLE001 - reported; the driver decides whether the executor survives
            send(conn, "error", (_name(method), traceback.format_exc()))
            continue
        if reply_rank is None or reply_rank == worker.rank:
            send(conn, "ok", result)


def _name(method: str | Any) -> str:
    """A call's name for messages: the method, or the callable's qualified name."""
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
