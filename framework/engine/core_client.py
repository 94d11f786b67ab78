"""How the API front reaches an engine core: on a thread of its own process, or in a process of its own over ZMQ
(vLLM V1's ``InprocClient`` / ``AsyncMPClient``).

Both clients take :data:`~framework.engine.core_messages.CoreCommand` objects and deliver every
:class:`~framework.engine.core_messages.EngineCoreOutputs` to one callback, ``on_event(replica_id, outputs)``,
called on a thread of theirs (the core's loop thread in-process; a reader thread over ZMQ), so the front
(:class:`~framework.engine.async_llm.AsyncLLM`) handles one kind of event whatever the layout.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework.distributed.process_start import child_launch, child_process, process_context
from framework.engine.core import EngineCore, engine_facts
from framework.engine.core_messages import (
    CommandEncoder,
    CoreCommand,
    EngineCoreOutputs,
    EngineFacts,
    OutputsEncoder,
    Shutdown,
)

logger = logging.getLogger(__name__)

OnEvent = Callable[[int, EngineCoreOutputs], None]
POLL_S = 0.2  # seconds the reader thread waits for a message before checking that the core process lives
#: seconds :meth:`MPCoreClient.shutdown` waits for a core still building or compiling (it reads no command until
#: its start-up work ends, which may take minutes) before it kills it; its ranks die with it
STARTING_CORE_WAIT_S = 2.0
TERMINAL_EVENTS = ("stopped", "dead", "failed")


class CoreClient(ABC):
    """One engine core (one data-parallel replica, or an in-process data-parallel front) as the API front sees it.

    Attributes:
        replica_id: the data-parallel rank of the core (its first replica's id).
        facts: the engine's facts once it is built (``hello``), else None.
        replays_hooks: the core runs in another process, so the front replays its lifecycle hooks
            (``on_engine_start``, ``on_step_end``, ``on_request_finished``) for this process's plugins.
    """

    replica_id: int = 0
    facts: EngineFacts | None = None
    replays_hooks: bool = False

    @abstractmethod
    def start(self, on_event: OnEvent) -> None:
        """Start the core; every event batch goes to ``on_event(self.replica_id, outputs)``."""

    @abstractmethod
    def send(self, command: CoreCommand) -> None:
        """Send one command (thread-safe)."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop (it aborts what is in flight, emits their outputs and ``stopped``) and wait up to
        ``timeout_s`` seconds for it; 0 only asks. Idempotent."""


class InprocCoreClient(CoreClient):
    """The core's loop on a daemon thread of this process (``server.engine_process=false``, ``LLM``'s tests).

    Args:
        engine: a built ``LLMEngine`` or ``DataParallelEngine``.
        startup: the core's start-up work (``EngineCore``'s ``startup``).
    """

    def __init__(self, engine: Any, startup: Callable[[], Any] | None = None) -> None:
        self.engine, self._startup = engine, startup
        self.facts = engine_facts(engine)
        self.core: EngineCore | None = None
        self._thread: threading.Thread | None = None

    def start(self, on_event: OnEvent) -> None:
        """Start the loop thread."""
        self.core = EngineCore(self.engine, lambda out: on_event(self.replica_id, out), self._startup, self.replica_id)
        self._thread = threading.Thread(target=self.core.run, name="servelab-engine-loop", daemon=True)
        self._thread.start()

    def send(self, command: CoreCommand) -> None:
        """Queue the command on the core."""
        self.core.put(command)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """See :meth:`CoreClient.shutdown`."""
        if self.core is not None:
            self.core.put(Shutdown())
        if self._thread is not None and timeout_s > 0:
            self._thread.join(timeout_s)

    @property
    def is_alive(self) -> bool:
        """True while the loop thread runs."""
        return self._thread is not None and self._thread.is_alive()


class MPCoreClient(CoreClient):
    """An engine core in a spawned process (:func:`framework.engine.core_proc.run_engine_core`), over two ZMQ
    ``ipc://`` sockets this side binds: PUSH for commands, PULL for events. On Linux they live in the abstract
    socket namespace (``ipc://@servelab-core-<pid>-...``): no file, so an API process killed outright leaves none
    behind; elsewhere they are files in a temporary folder removed at :meth:`shutdown`. The core process dies with
    this one (``framework.distributed.child_process``).

    A reader thread decodes events and calls ``on_event``; when the process exits without a last event
    (killed, out of memory), the reader reports ``dead`` itself with the exit status.

    Args:
        config: the replica's ``EngineConfig`` (``data_parallel_size=1``).
        replica_id: its data-parallel rank.
        data_parallel_size: replicas behind the front (with several, each core pins itself to its share of the
            CPUs: ``framework.distributed.parallel_state.replica_cpus``).
        metrics_kwargs: ``MetricsCollector`` arguments for the core.
    """

    replays_hooks = True

    def __init__(self, config: Any, replica_id: int = 0, data_parallel_size: int = 1,
                 metrics_kwargs: dict[str, Any] | None = None) -> None:
        self.config, self.replica_id, self.data_parallel_size = config, replica_id, data_parallel_size
        self.metrics_kwargs = metrics_kwargs or {}
        self.process: Any = None
        self._hello = threading.Event()
        self._ready = threading.Event()  # start-up work done: the core reads commands
        self._failure: EngineCoreOutputs | None = None
        self._terminal = threading.Event()
        self._send_lock = threading.Lock()
        self._closing = False
        self._encoder = CommandEncoder()
        self._dir: Path | None = None  # the sockets' folder where there is no abstract namespace

    def start(self, on_event: OnEvent) -> None:
        """Bind the sockets, spawn the process, start the reader thread."""
        import zmq

        from framework.engine.core_proc import run_engine_core

        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._events = self._context.socket(zmq.PULL)
        if sys.platform.startswith("linux"):
            prefix = f"ipc://@servelab-core-{os.getpid()}-{self.replica_id}-{secrets.token_hex(4)}"
        else:
            self._dir = Path(tempfile.mkdtemp(prefix="servelab-core-"))
            prefix = f"ipc://{self._dir}/core"
        input_address, output_address = f"{prefix}-input", f"{prefix}-output"
        self._commands.bind(input_address)
        self._events.bind(output_address)
        ctx = process_context()
        launch = child_launch(ctx)
        self.process = child_process(
            ctx, run_engine_core, name=f"servelab-engine-core-{self.replica_id}",
            args=(self.config, self.replica_id, input_address, output_address, self.data_parallel_size,
                  logging.getLogger().getEffectiveLevel(), self.metrics_kwargs, launch.parent_pid,
                  launch.started_by_main_thread))
        self.process.start()  # not a daemon: its executor may start worker processes of its own
        self._reader = threading.Thread(target=self._read, args=(on_event,), name=f"core-reader-{self.replica_id}",
                                        daemon=True)
        self._reader.start()

    def wait_for_hello(self, timeout_s: float | None = None) -> EngineFacts:
        """Block until the core built its engine; its facts.

        Raises:
            ValueError, FileNotFoundError, ImportError: the build refused the config (the core's message).
            RuntimeError: the build failed otherwise, or the process died first.
            TimeoutError: no answer within ``timeout_s`` seconds.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._hello.wait(0.5):
            if self._failure is not None or self._terminal.is_set():
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"engine core {self.replica_id} did not build its engine in {timeout_s:g} s")
        if self.facts is not None:
            return self.facts
        failure = self._failure
        message = failure.message if failure is not None else f"the engine core process exited ({self.process.exitcode})"
        raise _config_error(failure.error_type if failure is not None else "")(message)

    def send(self, command: CoreCommand) -> None:
        """Encode and push the command (dropped once the client is closed)."""
        data = self._encoder.encode(command)
        with self._send_lock:
            if not self._closing:
                self._commands.send(data, copy=False)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """See :meth:`CoreClient.shutdown`; the process is killed when it does not exit in time, and after
        :data:`STARTING_CORE_WAIT_S` when it is still building or compiling (it cannot read the command yet)."""
        if self.process is None:
            return
        if not self._terminal.is_set() and self.process.is_alive():
            self.send(Shutdown())
        if timeout_s <= 0:
            return
        starting = not self._ready.is_set()
        self.process.join(min(timeout_s, STARTING_CORE_WAIT_S) if starting else timeout_s)
        if starting and self._ready.is_set():  # it became ready meanwhile: it reads the command now
            starting = False
            self.process.join(max(timeout_s - STARTING_CORE_WAIT_S, 0.0))
        if self.process.is_alive():
            if starting:
                logger.info("engine core %d is still starting; stopping it", self.replica_id)
            else:
                logger.warning("engine core %d did not stop in %.0f s; killing it", self.replica_id, timeout_s)
            self.process.kill()
            self.process.join(5.0)
        self._reader.join(timeout_s)
        with self._send_lock:
            if not self._closing:
                self._closing = True
                self._commands.close(linger=0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        """True while the process runs and has not reported a terminal event."""
        return self.process is not None and self.process.is_alive() and not self._terminal.is_set()

    def _read(self, on_event: OnEvent) -> None:
        """Reader thread: decode events, watch the process, end after its terminal event."""
        decoder = OutputsEncoder()
        try:
            while not self._terminal.is_set():
                if self._events.poll(int(POLL_S * 1000)):
                    event = decoder.decode(self._events.recv(copy=False).buffer)
                    self._note(event)
                    on_event(self.replica_id, event)
                elif not self.process.is_alive():
                    while self._events.poll(0):  # what it sent before it went
                        event = decoder.decode(self._events.recv())
                        self._note(event)
                        on_event(self.replica_id, event)
                    if not self._terminal.is_set():
                        event = EngineCoreOutputs(event="dead", message=f"the engine core process {self.process.pid} "
                                                  f"exited with status {self.process.exitcode}", error_type="ProcessExit")
                        self._note(event)
                        on_event(self.replica_id, event)
        except Exception:  # noqa: BLE001 - a reader that dies would leave every request waiting
            logger.exception("engine core %d: the event reader failed", self.replica_id)
            on_event(self.replica_id, EngineCoreOutputs(event="dead", message="the event reader failed"))
        finally:
            self._events.close(linger=0)

    def _note(self, event: EngineCoreOutputs) -> None:
        if event.event == "hello":
            self.facts = event.facts
            self._hello.set()
        elif event.event == "ready":
            self._ready.set()
        elif event.event in TERMINAL_EVENTS:
            if event.event == "failed":
                self._failure = event
            self._terminal.set()


def _config_error(names: str) -> type[Exception]:
    """The exception class the front raises for a core's failed build whose exception's classes (most derived
    first, comma-separated) are ``names``: the first that is a configuration mistake the entry points report as
    such (``config_errors.CONFIG_ERRORS``), else ``RuntimeError``."""
    from framework import registry

    known = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "ImportError": ImportError,
             "ModuleNotFoundError": ImportError, "PluginConflictError": registry.PluginConflictError,
             "PluginVersionError": registry.PluginVersionError}
    return next((known[n] for n in names.split(",") if n in known), RuntimeError)
