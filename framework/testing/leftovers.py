"""What a run left behind: processes by pid, and ``/dev/shm`` names by comparing the whole folder before and after.

A fault test takes :func:`shm_snapshot` before it starts the run, strikes, then asks :func:`wait_for_nothing_left`
whether every process of the run has exited and no name appeared in ``/dev/shm`` that is still there. A name new
since the snapshot that a live process outside the run maps or holds open belongs to a program running at the
same time (another test, another user's server) and is not counted; a leftover of the run has no live user left.
This checks everything a run can leave (segments, ``sem.*`` semaphores, any program's names), unlike sampling
only the names the run's processes map, which misses a name created and left between two samples.

Linux only (``/proc`` and ``/dev/shm``); elsewhere the name checks see nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_snapshot(shm_dir: Path = SHM_DIR) -> frozenset[str]:
    """The names in ``shm_dir`` now (empty where it cannot be listed)."""
    try:
        return frozenset(os.listdir(shm_dir))
    except OSError:
        return frozenset()


def _inodes_in_use(shm_dir: Path) -> set[int]:
    """Inode numbers of the files in ``shm_dir`` that some live process maps (``/proc/<pid>/maps``) or holds open
    (``/proc/<pid>/fd``). By inode, not name: glibc's ``sem_open`` maps a temporary file that it then links to
    the semaphore's name and unlinks, so a live semaphore's mapping shows another (deleted) name."""
    prefix, inodes = f"{shm_dir}/", set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for line in Path(entry.path, "maps").read_text().splitlines():
                if prefix in line:
                    inodes.add(int(line.split(maxsplit=5)[4]))
            for fd in os.scandir(Path(entry.path, "fd")):
                if os.readlink(fd.path).startswith(prefix):
                    inodes.add(os.stat(fd.path).st_ino)
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return inodes


def new_shm_names(before: Iterable[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Names in ``shm_dir`` that were not there ``before`` and that no live process uses: what was left behind."""
    new = shm_snapshot(shm_dir) - set(before)
    if not new:
        return []
    used, left = _inodes_in_use(shm_dir), []
    for name in sorted(new):
        try:
            if os.stat(shm_dir / name).st_ino not in used:
                left.append(name)
        except OSError:  # removed meanwhile
            continue
    return left


def live_pids(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that still run (a zombie, which only waits for its parent to reap it, does not)."""
    alive = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" not in status:
            alive.append(pid)
    return alive


def wait_for_nothing_left(before: Iterable[str], pids: Iterable[int], within_s: float = 10.0,
                          shm_dir: Path = SHM_DIR) -> tuple[list[int], list[str]]:
    """Wait up to ``within_s`` seconds until none of ``pids`` runs and :func:`new_shm_names` is empty; returns
    ``(pids still running, names left)`` at that moment (both empty: nothing was left)."""
    before, pids = set(before), list(pids)
    deadline = time.monotonic() + within_s
    while True:
        alive, names = live_pids(pids), new_shm_names(before, shm_dir)
        if (not alive and not names) or time.monotonic() >= deadline:
            return alive, names
        time.sleep(0.1)
