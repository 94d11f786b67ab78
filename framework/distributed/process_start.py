"""How servelab starts its child processes (worker ranks, engine cores): the ``multiprocessing`` context, and
what a child must be handed so that it behaves the same whichever context started it.

``forkserver`` (the default on Linux; ``SERVELAB_WORKER_MULTIPROC_METHOD=forkserver|spawn``, as vLLM's
``VLLM_WORKER_MULTIPROC_METHOD``): the first child start of a process launches one fork server, which imports
torch, transformers and servelab's worker and engine-core modules once (:data:`PRELOAD`); every child is then
forked from it, skipping the ~3-6 s per child of importing them again (a ``tensor_parallel_size=2`` engine on
stories260K started in 16 s with ``spawn`` on a 2-core Xeon). The fork server never runs a torch operator, so
its children start with no OpenMP pool or other thread to lose in the fork. ``spawn`` (other platforms, or when
asked) starts a fresh interpreter per child.

A child forked from the server would differ from a spawned one in four inherited things; :func:`child_process`
hands them over explicitly, so both contexts behave alike:

* **the environment**: the server's is a snapshot from when it started; the child gets the launcher's of now;
* **standard output and error**: the child writes where its launcher's file descriptors 1 and 2 point now
  (a server redirected to a log file, a test's captured output), passed as descriptors;
* **its CPU affinity**: the launching thread's now (a data-parallel replica's ranks are started pinned to its cores);
* **its parent**: the fork server, not the launcher. The server exits as soon as its launcher dies (it waits
  on a pipe only the launcher holds), so a child that watches the server dies with the launcher:
  :attr:`ChildLaunch.parent_pid` is the pid to watch and :attr:`ChildLaunch.started_by_main_thread` whether
  the kernel's parent-death signal can be armed (:mod:`framework.distributed.child_process`). The server's exit
  takes seconds (its interpreter shuts down with torch loaded), so every child also waits on its launcher's
  pidfd and exits the moment the launcher does.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.context import BaseContext, get_spawning_popen
from typing import Any

from framework.distributed.child_process import EXIT_PARENT_GONE, spawned_by_main_thread

#: environment variable choosing how children start: ``forkserver`` (Linux default) or ``spawn``
MULTIPROC_METHOD_ENV = "SERVELAB_WORKER_MULTIPROC_METHOD"
METHODS = ("forkserver", "spawn")
#: modules the fork server imports once for all its children (an import error only skips that module)
PRELOAD = ["torch", "transformers", "torch._inductor.compile_fx", "framework.worker.worker_proc",
           "framework.worker.worker", "framework.engine.core_proc"]  # inductor: attention kernels compile at start-up


def multiproc_method() -> str:
    """``forkserver`` on Linux unless ``SERVELAB_WORKER_MULTIPROC_METHOD`` says ``spawn``; ``spawn`` elsewhere.

    Raises:
        ValueError: the variable names another method.
    """
    chosen = os.environ.get(MULTIPROC_METHOD_ENV, "").strip().lower()
    if chosen and chosen not in METHODS:
        raise ValueError(f"{MULTIPROC_METHOD_ENV}={chosen!r}: use one of {', '.join(METHODS)}")
    if chosen:
        return chosen
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


def process_context() -> BaseContext:
    """The ``multiprocessing`` context servelab starts children with (:func:`multiproc_method`); the fork
    server's preload list is set before its first start."""
    ctx = mp.get_context(multiproc_method())
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass(frozen=True)
class ChildLaunch:
    """What a child must know about how it was started (pass both to its entry point).

    Attributes:
        parent_pid: the pid the child watches: the launcher's under ``spawn``, the fork server's under
            ``forkserver`` (which exits with the launcher).
        started_by_main_thread: whether the child's parent thread lives as long as the launcher process (the
            launcher's main thread under ``spawn``; always under ``forkserver``, whose main thread forks).
    """

    parent_pid: int
    started_by_main_thread: bool


def sweep_stale_server_dirs(tmp: str | None = None) -> list[str]:
    """Remove what SIGKILLed launchers left in the temp folder: a ``pymp-*`` folder of this user holding only
    fork-server sockets (``listener-*``) that no live process has bound any more (a launcher's ``multiprocessing``
    removes its folder at exit, which a SIGKILL skips). A live server's folder, or one holding anything else,
    is kept. Never raises; returns the removed folders."""
    removed: list[str] = []
    bound = _bound_unix_paths()
    if bound is None:
        return removed
    root = tmp or tempfile.gettempdir()
    try:
        candidates = [e for e in os.scandir(root) if e.name.startswith("pymp-") and e.is_dir(follow_symlinks=False)
                      and e.stat(follow_symlinks=False).st_uid == os.getuid()]
    except OSError:
        return removed
    for folder in candidates:
        try:
            names = os.listdir(folder.path)
            if not names or not all(n.startswith("listener-") for n in names):
                continue
            if any(os.path.join(folder.path, n) in bound for n in names):
                continue
            shutil.rmtree(folder.path, ignore_errors=True)
            removed.append(folder.path)
        except OSError:
            continue
    return removed


def _bound_unix_paths() -> set[str] | None:
    """Paths of the Unix sockets some live process has bound (Linux ``/proc/net/unix``; ``None`` elsewhere).
    Read, never connected to: a probe connection would make a live fork server fail on its next request."""
    try:
        with open("/proc/net/unix") as table:
            return {fields[7] for line in table.readlines()[1:] if len(fields := line.split()) >= 8}
    except OSError:
        return None


def child_launch(ctx: BaseContext) -> ChildLaunch:
    """In the launcher, before it starts a child with ``ctx``: the child's :class:`ChildLaunch` (under
    ``forkserver`` this starts the server if it is not running, first removing stale servers' folders:
    :func:`sweep_stale_server_dirs`)."""
    if ctx.get_start_method() != "forkserver":
        return ChildLaunch(os.getpid(), spawned_by_main_thread())
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:  # noqa: SLF001 - first start in this process
        sweep_stale_server_dirs()
    forkserver.ensure_running()
    return ChildLaunch(forkserver._forkserver._forkserver_pid, True)  # noqa: SLF001 - the stdlib keeps it private


class InheritedFd:
    """A file descriptor that pickles only into a process ``multiprocessing`` is starting: it is duplicated into
    the child (by number under ``spawn``, over the fork server's socket under ``forkserver``), as a
    ``Connection``'s is."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        if get_spawning_popen() is None:
            raise TypeError("an inherited descriptor passes only to a process being started by multiprocessing "
                            "(a Process argument)")
        return InheritedFd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup: Any) -> InheritedFd:
        return InheritedFd(dup.detach())

    def close(self) -> None:
        """Close this process's descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_fd(fd: int) -> InheritedFd | None:
    """``fd`` to pass on, or ``None`` when this process has it closed."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return InheritedFd(fd)


def _release_parent_server() -> None:
    """In a child forked by a fork server: close the server's "alive" descriptor that ``multiprocessing`` hands
    every such child (so that it could start siblings through the same server). Held by the child, it would keep
    the server, and so the child itself, alive after the launcher died; this child starts its own server when
    it starts children."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the stdlib keeps its state private
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:  # noqa: SLF001
        with contextlib.suppress(OSError):
            os.close(server._forkserver_alive_fd)  # noqa: SLF001
        server._forkserver_alive_fd = server._forkserver_address = None  # noqa: SLF001


def _affinity() -> frozenset[int] | None:
    """The calling thread's CPU affinity (``None`` where the platform has none)."""
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _exit_with_launcher(launcher_pid: int) -> None:
    """Exit (``EXIT_PARENT_GONE``) the moment the launcher process ends, from a daemon thread waiting on its pidfd
    (Linux 5.3+; elsewhere nothing: the parent watchers of ``child_process`` remain). The fork server also exits
    with the launcher, and its children with it, but only after its interpreter shut down (seconds, torch loaded);
    a pidfd needs no polling and cannot be fooled by a reused pid."""
    if not hasattr(os, "pidfd_open"):
        return
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        os._exit(EXIT_PARENT_GONE)  # gone before we started
    except OSError:
        return

    def wait() -> None:
        select.select([pidfd], [], [])  # readable once the launcher has exited
        os._exit(EXIT_PARENT_GONE)

    threading.Thread(target=wait, name="servelab-launcher-watch", daemon=True).start()


def _child_entry(target: Callable[..., Any], args: tuple, env: dict[str, str], stdout: InheritedFd | None,
                 stderr: InheritedFd | None, cpus: frozenset[int] | None = None,
                 launcher_pid: int | None = None) -> Any:
    """The child's first step: let go of its fork server, die with its launcher, take the launcher's environment,
    standard streams and CPU affinity, then run ``target``."""
    _release_parent_server()
    if launcher_pid is not None:
        _exit_with_launcher(launcher_pid)
    if cpus is not None and cpus != _affinity():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    for inherited, fd in ((stdout, 1), (stderr, 2)):
        if inherited is not None and inherited.fd != fd:
            with contextlib.suppress(OSError):
                os.dup2(inherited.fd, fd)
            inherited.close()
    return target(*args)


def child_process(ctx: BaseContext, target: Callable[..., Any], args: tuple, name: str,
                  daemon: bool | None = None) -> mp.process.BaseProcess:
    """``ctx.Process(target=target, args=args, ...)`` (not started) whose child first takes this process's
    environment, standard output/error and this thread's CPU affinity as they are now (see the module docstring);
    ``target`` must be importable (it travels by reference)."""
    return ctx.Process(target=_child_entry, name=name, daemon=daemon,
                       args=(target, args, dict(os.environ), _open_fd(1), _open_fd(2), _affinity(), os.getpid()))


@contextlib.contextmanager
def standard_start_method() -> Iterator[None]:
    """Make the process-wide start method ``spawn`` while a child starts, when it is one the child
    cannot set up (a spawned child re-applies its parent's start method before anything else runs:
    inside a joblib/loky worker, e.g. a sweep under ``hydra/launcher=joblib``, that is ``loky``, and
    the child fails with ``cannot find context for 'loky'``). Restored afterwards."""
    current = mp.get_start_method(allow_none=True)
    if current in (None, "spawn", "fork", "forkserver"):
        yield
        return
    mp.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        mp.set_start_method(current, force=True)
