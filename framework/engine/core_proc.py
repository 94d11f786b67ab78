"""The engine core in a process of its own (vLLM V1's ``EngineCoreProc``): :func:`run_engine_core` is its entry.

The process builds its engine from the config it is given (one data-parallel replica: its own scheduler, KV cache
and executor, which may start tensor-parallel workers of its own), then runs :class:`~framework.engine.core.
EngineCore` on its main thread. Two I/O threads keep serialization off that thread, as vLLM's do: the input thread
receives msgpack commands from the front's PUSH socket and queues them; the output thread encodes each
``EngineCoreOutputs`` and sends it (ZMQ copies happen while the loop thread runs the next forward, which releases
the GIL).

Life cycle, as seen by the front: ``hello`` (the engine is built; its facts), ``ready`` (start-up work done, e.g.
the compile warm-up), step outputs..., then ``stopped`` (after a shutdown command; exit status 0) or ``dead``
(exit status 1). A build that refuses the config sends ``failed`` with the message and exits 2. The process dies
with its parent (the API process) at any moment, loading and compiling included: the kernel's parent-death
signal and a watcher thread armed before anything is built (:mod:`framework.distributed.child_process`; exit status
:data:`~framework.distributed.child_process.EXIT_PARENT_GONE`), so a server ended by any signal leaves no engine
core behind; its tensor-parallel ranks die with it the same way.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any

from framework.config import EngineConfig
from framework.distributed.child_process import avoid_named_semaphores, die_with_parent, set_process_name
from framework.engine.core_messages import (
    CommandEncoder,
    EngineCoreOutputs,
    OutputsEncoder,
    Shutdown,
)
from framework.hookspecs import hookimpl

logger = logging.getLogger(__name__)

INPUT_POLL_MS = 1000  # the input thread's longest wait for a command, milliseconds
DEAD_EXIT_S = 5.0  # seconds a dead core waits for its last events to leave before it exits anyway
EXIT_DEAD, EXIT_FAILED = 1, 2  # exit statuses: the engine died / the build refused the config


def join_data_parallel(replica_id: int, data_parallel_size: int) -> None:
    """Record this process as replica ``replica_id`` of ``data_parallel_size``
    (``framework.distributed.parallel_state``); with several replicas, pin it to its share of the CPUs (before
    any thread or TP rank starts, so they inherit it) and use one torch thread per CPU."""
    from framework.distributed import parallel_state

    group = parallel_state.initialize_data_parallel(replica_id, data_parallel_size, pin=data_parallel_size > 1)
    if data_parallel_size > 1:
        import torch

        torch.set_num_threads(len(group.cpus))


def run_engine_core(config: EngineConfig, replica_id: int, input_address: str, output_address: str,
                    data_parallel_size: int = 1, log_level: int = logging.INFO,
                    metrics_kwargs: dict[str, Any] | None = None, parent_pid: int | None = None,
                    started_by_main_thread: bool = False) -> None:
    """Build one engine and serve it over ZMQ until shut down; the body of an engine-core process.

    Args:
        config: the replica's config (``data_parallel_size=1``; its executor may be tensor-parallel).
        replica_id: this core's data-parallel rank (its stats carry it).
        input_address, output_address: the front's bound ZMQ addresses (``ipc://...``): commands come from the
            first (PULL), events go to the second (PUSH).
        data_parallel_size: replicas behind the front (:func:`join_data_parallel`).
        log_level: the front's logging level, applied to this process's root logger.
        metrics_kwargs: ``MetricsCollector`` arguments (SLOs, ``max_records``).
        parent_pid: the API process's pid (``None``: this process's parent now); the core dies with it.
        started_by_main_thread: the API process started this one from its main thread (arms the kernel's
            parent-death signal: ``framework.distributed.child_process``).

    Exits with 0 after a shutdown, :data:`EXIT_DEAD` when the engine died, :data:`EXIT_FAILED` when the build
    refused the config, ``EXIT_PARENT_GONE`` when the API process is gone.
    """
    logging.basicConfig(level=log_level, format=f"%(asctime)s [core {replica_id}] %(levelname)s %(name)s: %(message)s")
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    set_process_name(f"servelab-core{replica_id}")  # ps, /proc/<pid>/comm
    die_with_parent(parent_pid, started_by_main_thread, name="core-parent-watch",  # before anything is built
                    on_gone=lambda: logger.error("the API process (pid %d) is gone; the engine core exits", parent_pid))
    avoid_named_semaphores()  # before the weights' progress bar
    import zmq

    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    encoder = OutputsEncoder()
    out_queue: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_send_loop, args=(outputs, encoder, out_queue), name="core-output", daemon=True)
    sender.start()
    status = _serve(config, replica_id, data_parallel_size, inputs, out_queue, metrics_kwargs or {})
    out_queue.put(None)  # flush what is queued, then the sender ends
    sender.join(10.0)
    outputs.close(linger=2000)
    inputs.close(linger=0)
    context.term()
    os._exit(status)  # noqa: SLF001 - no atexit/finalizers of half-dead worker state after a fault


def _serve(config: EngineConfig, replica_id: int, data_parallel_size: int, inputs: Any, out_queue: queue.Queue,
           metrics_kwargs: dict[str, Any]) -> int:
    """Build, announce, run the core; returns the process's exit status."""
    from framework import registry
    from framework.engine.builder import build_llm_engine
    from framework.engine.core import EngineCore, engine_facts
    from framework.metrics.collector import MetricsCollector

    forwarder = HookForwarder()
    registry.plugin_manager().register(forwarder, name="engine-core-hook-forwarder")
    try:
        join_data_parallel(replica_id, data_parallel_size)  # before torch's threads and any TP rank start
        engine = build_llm_engine(config, metrics=MetricsCollector(**metrics_kwargs), defer_compile=True)
    except BaseException as exc:  # noqa: BLE001 - reported to the front (a config error exits it with the message)
        if not isinstance(exc, (ValueError, FileNotFoundError, ImportError)):
            logger.exception("building the engine failed")
        out_queue.put(EngineCoreOutputs(event="failed", message=str(exc),  # its classes, most derived first
                                        error_type=",".join(c.__name__ for c in type(exc).__mro__)))
        return EXIT_FAILED
    out_queue.put(EngineCoreOutputs(event="hello", facts=engine_facts(engine)))

    def emit(event: EngineCoreOutputs) -> None:
        out_queue.put(event)
        if event.event == "dead":  # a hung step never returns to run(): exit once the event is on its way
            threading.Timer(DEAD_EXIT_S, lambda: (out_queue.put(None), os._exit(EXIT_DEAD))).start()

    core = EngineCore(engine, emit=emit, startup=lambda: engine.maybe_compile(None), replica_id=replica_id,
                      step_stats=forwarder.drain)
    receiver = threading.Thread(target=_receive_loop, args=(inputs, core), name="core-input", daemon=True)
    receiver.start()
    try:
        core.run()
    finally:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - the process is ending; the workers die with it
            logger.exception("engine shutdown failed")
    return EXIT_DEAD if core.dead is not None else 0


class HookForwarder:
    """Collects this process's ``on_step_end`` calls for the front to replay (``EngineCoreOutputs.step_stats``);
    ``on_request_finished`` needs no forwarding (the front sees every finished output), ``on_engine_start``
    rides on ``hello`` (``EngineFacts.config``)."""

    def __init__(self) -> None:
        self._stats: list[Any] = []
        self._lock = threading.Lock()

    @hookimpl
    def on_step_end(self, stats: Any) -> None:
        """Keep the step's stats until the next event."""
        with self._lock:
            self._stats.append(stats)

    def drain(self) -> list[Any]:
        """The stats collected since the previous call."""
        with self._lock:
            out, self._stats = self._stats, []
        return out


def _receive_loop(inputs: Any, core: Any) -> None:
    """Input thread: decode commands into the core's queue until a shutdown (a dead parent is the watcher's)."""
    decoder = CommandEncoder()
    while True:
        if inputs.poll(INPUT_POLL_MS):
            try:
                command = decoder.decode(inputs.recv())
            except Exception:  # noqa: BLE001 - a malformed frame must not kill the core
                logger.exception("dropping a malformed command frame")
                continue
            core.put(command)
            if isinstance(command, Shutdown):
                return


def _send_loop(outputs: Any, encoder: OutputsEncoder, out_queue: queue.Queue) -> None:
    """Output thread: encode and send every event until the ``None`` sentinel."""
    while True:
        item = out_queue.get()
        if item is None:
            return
        outputs.send(encoder.encode(item), copy=False)
