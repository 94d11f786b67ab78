"""Stop a local Ray instance whose driver died (``executor=ray`` with a cluster it started itself).

``ray.init()`` without an address starts the node's processes (``gcs_server``, ``raylet``, the dashboard and
runtime-env agents, the workers) as descendants of the driver. A driver that exits stops them
(``ray.shutdown``); a SIGKILLed one cannot, and Ray's agents then notice their raylet is gone only after
about a minute (they first try to report it to the GCS, which died too). This reaper closes that window:

* the executor starts it (:func:`start_reaper`) right after ``ray.init`` as a small child process
  (stdlib only: no torch import) holding the read end of a pipe whose write end only the driver holds
  (non-inheritable, so Ray's processes do not keep it open);
* the driver's death closes the pipe (the kernel does it, whatever killed the driver): the reaper reads
  EOF and sends SIGKILL to every process whose command line names this Ray session
  (``session_<date>_<pid>``: the GCS, the raylet, the monitors) and to their descendants (the agents and
  workers, which rename themselves), found by a look every second while the driver lives (the raylet dies
  with the driver, and its orphaned agents then name nothing of the session), then exits;
* a clean ``shutdown`` writes ``done`` before closing: the reaper exits without killing anything
  (``ray.shutdown`` stops the node itself).

A group kill (SIGKILL of the driver's process group) ends the reaper too, and the Ray processes with it
(they are in the group). Linux only (``/proc``); elsewhere :func:`start_reaper` returns ``None``.

Run as ``python -m plugins.executors._ray_reaper SESSION_NAME``.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

DONE = b"done\n"  # what a clean shutdown writes before closing the pipe
#: what a Ray session's name looks like (``session_2026-11-28_21-32-35_880906_20371``): anything else is refused,
#: since every process whose command line contains the name is killed
SESSION_NAME = re.compile(r"session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_\d+")
LOOK_EVERY_S = 1.0  # seconds between two looks at the session's processes (/proc scans of a few ms)


def session_pids(session_name: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the live processes whose command line contains ``session_name`` (this process excluded).

    Raises:
        ValueError: ``session_name`` is not a Ray session's name (:data:`SESSION_NAME`).
    """
    if not SESSION_NAME.fullmatch(session_name):
        raise ValueError(f"not a Ray session name: {session_name!r} (expected session_<date>_<time>_<us>_<pid>)")
    needle, pids = session_name.encode(), []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return pids


def _stats(proc: Path = Path("/proc")) -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot) of every live process (``/proc/<pid>/stat``)."""
    stats = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
        stats[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return stats


def session_tree(session_name: str) -> dict[int, int]:
    """The session's processes (:func:`session_pids`) and all their descendants, pid -> start time (clock
    ticks): Ray's agents and workers rename themselves (``ray::DashboardAgent``, ``ray::IDLE``), so only their
    parent, the raylet, names the session."""
    stats = _stats()
    pids = set(session_pids(session_name)) & set(stats)
    grew = True
    while grew:
        children = {pid for pid, (parent, _) in stats.items() if parent in pids and pid not in pids}
        pids |= children
        grew = bool(children)
    pids.discard(os.getpid())
    return {pid: stats[pid][1] for pid in sorted(pids)}


def reap(session_name: str, known: dict[int, int] | None = None) -> list[int]:
    """SIGKILL every process of the Ray session ``session_name`` and their descendants, and those of ``known``
    (pid -> start time, from earlier looks) still running with the same start time (not a reused pid): a
    raylet that died with the driver has left its agents orphaned, no longer its descendants. Returns the pids
    signalled."""
    targets = dict(known or {})
    targets.update(session_tree(session_name))
    stats = _stats()
    pids = [pid for pid, started in targets.items() if pid in stats and stats[pid][1] == started and pid != os.getpid()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    return pids


def start_reaper(session_name: str) -> subprocess.Popen | None:
    """Start the reaper of the Ray session ``session_name`` (see the module docstring); keep the returned
    process and call :func:`stop_reaper` with it at a clean shutdown. ``None`` where ``/proc`` is missing.

    Raises:
        OSError: the process could not be started.
    """
    if not Path("/proc/self/cmdline").exists() or not SESSION_NAME.fullmatch(session_name):
        return None
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.Popen([sys.executable, "-m", "plugins.executors._ray_reaper", session_name],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, cwd=repo_root, env=env)


def stop_reaper(reaper: subprocess.Popen | None) -> None:
    """Tell the reaper the driver shut down cleanly (it exits without killing); never raises."""
    if reaper is None:
        return
    try:
        reaper.stdin.write(DONE)
        reaper.stdin.close()
        reaper.wait(5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        reaper.kill()


def main(session_name: str) -> int:
    """Until the driver closes stdin, note the session's processes every :data:`LOOK_EVERY_S`; then reap them
    unless the driver said ``done``."""
    if not SESSION_NAME.fullmatch(session_name):
        print(f"_ray_reaper: not a Ray session name: {session_name!r}; nothing will be reaped", file=sys.stderr)
        return 2
    said, known = b"", {}
    while True:
        ready, _, _ = select.select([0], [], [], LOOK_EVERY_S)
        if not ready:
            known.update(session_tree(session_name))
            continue
        try:
            chunk = os.read(0, 64)
        except OSError:
            break
        if not chunk:
            break
        said += chunk
    if said != DONE:
        reap(session_name, known)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the driver's to handle
    sys.exit(main(sys.argv[1]))
