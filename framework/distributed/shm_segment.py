"""Shared-memory segments that a crash cannot leave behind in ``/dev/shm``.

Two kinds, by how the other processes find the segment:

* **Passed down** (:class:`AnonymousSegment`): a ``memfd_create`` file (Linux) has no name at any moment, so
  nothing can outlive its last user. Its descriptor travels to a ``multiprocessing`` child started with
  ``spawn`` as a ``Process`` argument (duplicated into the child like a ``Connection``'s), which maps it.
  Where ``memfd_create`` is missing (macOS) it falls back to an owned name, removed once every user holds it.
* **Found by name** (:func:`owned_name`): ranks that learn a name over ``torch.distributed`` (the
  shared-memory communicator) need a name for a moment. It reads ``servelab_<creator pid>_<pid namespace>_
  <random>``, so that :func:`sweep_stale_segments`, run when an engine starts, removes those whose creator
  died before unlinking them (a SIGKILL of the whole process group between create and unlink) and
  never touches another program's, or a live servelab's in another pid namespace (two containers sharing
  ``/dev/shm``).

vLLM's and SGLang's CPU paths sweep the stale segments they own at start-up the same way; the name-free
segment is the stronger form (nothing to sweep).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

from framework.distributed.process_start import InheritedFd

logger = logging.getLogger(__name__)

OWNED_PREFIX = "servelab_"  # every /dev/shm name servelab creates starts with this
SHM_DIR = Path("/dev/shm")


def _pid_namespace() -> str:
    """This process's pid namespace as 8 hex digits (``/proc/self/ns/pid``), ``""`` where there is none."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""
    return f"{int(link.split('[')[1].rstrip(']')) & 0xFFFFFFFF:08x}"


def owned_name(kind: str = "") -> str:
    """A fresh segment name this process owns: ``servelab_<pid>_<pid namespace>_<kind><random>`` (``kind``: up to
    4 letters). Without ``/proc`` (macOS) there is no namespace part and the name fits macOS's 30 characters."""
    ns = _pid_namespace()
    return f"{OWNED_PREFIX}{os.getpid()}_{ns + '_' if ns else ''}{kind[:4]}{secrets.token_hex(3)}"


def _creator(name: str) -> tuple[int, str] | None:
    """``(creator pid, pid namespace)`` of an owned name, ``None`` for any other name."""
    if not name.startswith(OWNED_PREFIX):
        return None
    parts = name[len(OWNED_PREFIX):].split("_")
    if not parts[0].isdigit():
        return None
    return int(parts[0]), parts[1] if len(parts) == 3 else ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the owned segments (:func:`owned_name`) of this pid namespace whose creator process no longer
    exists; returns their names. Other programs' names, and owned names of another namespace, are kept. A
    creator pid reused by a new process keeps its segment until that process ends (never a live one removed).
    Where ``shm_dir`` cannot be listed (macOS) there is nothing to sweep. Never raises."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    ns, removed = _pid_namespace(), []
    for name in names:
        creator = _creator(name)
        if creator is None or creator[1] != ns or _alive(creator[0]):
            continue
        try:
            os.unlink(shm_dir / name)
        except OSError:  # another sweeper was first, or not ours to remove
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d shared-memory segment(s) left by servelab processes that died: %s",
                    len(removed), ", ".join(sorted(removed)))
    return removed


_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier (a lock's acquire and release) between our shared-memory stores and the
    store or load that publishes them to another process; a no-op on x86 in practice, needed on
    weaker memory models (Arm)."""
    with _fence_lock:
        pass  # the acquire and the release are the barrier


_attach_lock = threading.Lock()


def attach_shared_memory(name: str) -> SharedMemory:
    """Map an existing segment without registering it with this process's resource tracker (Python
    3.13's ``SharedMemory(name, track=False)``): only its creator tracks it and unlinks it.

    Why: processes spawned by ``multiprocessing`` share their parent's tracker, so an attachment that
    registers and later unregisters the creator's name makes the creator's ``unlink`` unregister it a
    second time, and the tracker prints ``KeyError: '/psm_...'`` with a traceback (every ``mp`` start
    with two ranks did). A process with a tracker of its own (a Ray actor) would instead "clean up" a
    segment it never owned at exit. Before 3.13 the registration is skipped for the duration of the
    call (under a lock: attachments are start-up work).

    Raises:
        FileNotFoundError: no segment of that name (already unlinked).
    """
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    with _attach_lock:
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


class Mapping:
    """One process's mapping of a segment: :attr:`buf` until :meth:`close`."""

    def __init__(self, mapped: mmap.mmap | SharedMemory) -> None:
        self._mapped = mapped
        self.buf: memoryview = mapped.buf if isinstance(mapped, SharedMemory) else memoryview(mapped)

    def close(self) -> None:
        """Unmap (a view still alive in this process keeps the mapping until the process ends). Idempotent."""
        self.buf.release()
        with contextlib.suppress(BufferError):  # a view still alive: the mapping stays until the process ends
            self._mapped.close()


class AnonymousSegment:
    """``size_bytes`` of zero-filled shared memory without a name (Linux ``memfd_create``), else with an owned
    name that :meth:`forget_name` removes (the fallback). Create it in the owner, pass it to spawned children
    as a ``Process`` argument; each process (the owner too, any number of times) calls :meth:`map`.

    Args:
        size_bytes: the segment's size, bytes.

    Raises:
        OSError: the kernel refused the memory (``ENOMEM``, ``EMFILE``).
    """

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.name: str | None = None  # the fallback's /dev/shm name while it exists
        self._fd: InheritedFd | None = None
        self._shm: SharedMemory | None = None  # the fallback's owner handle
        self.owned = True  # False in the copies passed to other processes
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("servelab", os.MFD_CLOEXEC)
            os.ftruncate(fd, size_bytes)
            self._fd = InheritedFd(fd)
        else:
            self._shm = SharedMemory(name=owned_name("seg"), create=True, size=size_bytes)
            self.name = self._shm.name

    def __getstate__(self) -> dict:
        return {"size_bytes": self.size_bytes, "name": self.name, "_fd": self._fd, "_shm": None, "owned": False}

    def map(self) -> Mapping:
        """A new mapping of the segment in this process.

        Raises:
            FileNotFoundError: the fallback's name is gone already (every user must map before
                :meth:`forget_name`).
        """
        if self._fd is not None:
            return Mapping(mmap.mmap(self._fd.fd, self.size_bytes))
        return Mapping(attach_shared_memory(self.name))

    def forget_name(self) -> None:
        """Owner: remove the fallback's name once every user mapped the segment; the mappings stay. A no-op
        for a memfd (it never had a name) and in a process that does not own the segment. Idempotent."""
        if self._shm is not None:
            with contextlib.suppress(FileNotFoundError):  # already unlinked
                self._shm.unlink()
            self._shm.close()
            self._shm = None

    def close(self) -> None:
        """Close this process's descriptor of the segment (existing mappings stay) and, in the owner, forget the
        fallback's name. Idempotent."""
        self.forget_name()
        if self._fd is not None:
            self._fd.close()
