"""What every servelab child process (a worker rank, an engine core) does first: die with its parent at any moment
of its life (loading weights and compiling included), and create nothing with a name that only the parent's
``multiprocessing`` resource tracker would remove.

Dying with the parent takes two mechanisms, both armed before the child builds anything:

* **The kernel's parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, SGLang's
  ``kill_itself_when_parent_died``): the child is killed the moment its parent exits, whatever its own threads
  are doing (a compile that holds the main thread for minutes, a C call that never releases the GIL). The
  kernel sends it when the *thread* that started the child exits, so it is armed only for a child started
  from its parent's main thread (a thread of a pool that ends would kill a healthy child); the caller says
  which (:func:`spawned_by_main_thread`, evaluated in the parent).
* **A watcher thread** (vLLM's ``EngineProcObserver`` / its workers' death pipe): every
  :data:`PARENT_CHECK_S` it compares ``os.getppid()`` with the parent's pid (a dead parent's children are
  re-parented to init or a subreaper) and ends the process with ``os._exit``: the mechanism everywhere else
  (other platforms, children of other threads), and the one that can run a last callback.

Exiting with ``os._exit`` skips ``atexit`` and finalizers on purpose: nothing of the process is named (the
step ring and its wake-ups have no name, the communicator's segment lost its name at start-up), and a
half-dead process's finalizers would talk to a parent that is gone.

Nothing named (:func:`avoid_named_semaphores`): in a process started with ``spawn`` the default
``multiprocessing`` context is ``spawn``, so a library's ``multiprocessing.RLock()`` is a named POSIX semaphore
(``/dev/shm/sem.mp-*``) until the process ends, removed only by the resource tracker, which a SIGKILL of the
whole process group kills too. tqdm creates one at the first progress bar (transformers' "Loading weights"),
which is how a killed ``servelab serve`` left a ``sem.mp-*`` behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5  # seconds between two checks of the watcher thread
EXIT_PARENT_GONE = 3  # exit status of a process whose parent died
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_NAME = 15


def spawned_by_main_thread() -> bool:
    """In the parent, when starting a child: True when this is the process's main thread (the parent-death
    signal then fires only when the process exits)."""
    return threading.current_thread() is threading.main_thread()


def arm_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread exits (Linux); True when armed.
    Never raises: on other platforms, or if ``prctl`` fails, it returns False (the watcher still works)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_process_name(name: str) -> bool:
    """Name this process for ``ps``, ``top`` and ``/proc/<pid>/comm`` (Linux ``PR_SET_NAME``, at most 15 bytes:
    ``servelab-rank0``, ``servelab-core0``); a forked or spawned child otherwise shows its launcher's command line.
    Call it from the main thread (the name is the calling thread's; threads started later inherit it). Never raises;
    True when set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def avoid_named_semaphores() -> None:
    """Keep libraries from creating named semaphores in this process: tqdm's cross-process write lock (a
    ``multiprocessing.RLock``, only useful to bars of processes forked from this one) is turned off, its thread
    lock stays. Call it before the first progress bar; never raises."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):  # create_mp_lock() keeps an existing value
        TqdmDefaultWriteLock.mp_lock = None


def die_with_parent(parent_pid: int, started_by_main_thread: bool, on_gone: Callable[[], None] | None = None,
                    exit_code: int = EXIT_PARENT_GONE, name: str = "servelab-parent-watch") -> threading.Thread:
    """Arm both mechanisms (see the module docstring) in a child whose parent is ``parent_pid``; call it first
    thing in the child. Exits at once (``exit_code``) if the parent is gone already (it died before the signal
    was armed).

    Args:
        parent_pid: the parent's pid, as the parent saw it (``os.getpid()`` there).
        started_by_main_thread: :func:`spawned_by_main_thread` in the parent; arms the kernel's signal.
        on_gone: run on the watcher thread when the parent is found gone, before the exit (a log line); its
            exceptions are logged and ignored.
        exit_code: the process's exit status when its parent is gone.
        name: the watcher thread's name.

    Returns:
        The watcher thread (a daemon).
    """
    if started_by_main_thread:
        arm_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(exit_code)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(PARENT_CHECK_S):
            if os.getppid() != parent_pid:
                if on_gone is not None:
                    try:
                        on_gone()
                    except Exception:  # noqa: BLE001 - the exit matters more than the callback
                        logger.exception("parent-death callback failed")
                os._exit(exit_code)

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread
