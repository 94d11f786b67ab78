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
  (``session_<date>_<pid>``, passed to every Ray process of the instance), then exits;
* a clean ``shutdown`` writes ``done`` before closing: the reaper exits without killing anything
  (``ray.shutdown`` stops the node itself).

A group kill (SIGKILL of the driver's process group) ends the reaper too, and the Ray processes with it
(they are in the group). Linux only (``/proc``); elsewhere :func:`start_reaper` returns ``None``.

Run as ``python -m plugins.executors._ray_reaper SESSION_NAME``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

DONE = b"done\n"  # what a clean shutdown writes before closing the pipe


def session_pids(session_name: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the live processes whose command line contains ``session_name`` (this process excluded)."""
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


def reap(session_name: str) -> list[int]:
    """SIGKILL every process of the Ray session ``session_name``; returns their pids."""
    pids = session_pids(session_name)
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
    if not Path("/proc/self/cmdline").exists() or not session_name:
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
    """Block until the driver closes stdin; reap the session unless it said ``done``."""
    said = b""
    try:
        while chunk := os.read(0, 64):
            said += chunk
    except OSError:
        pass
    if said != DONE:
        reap(session_name)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the driver's to handle
    sys.exit(main(sys.argv[1]))
