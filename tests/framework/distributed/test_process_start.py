"""How children start (``framework/distributed/process_start.py``): the fork server's children take the launcher's
environment and standard streams as they are when the child starts, watch the server, and a SIGKILLed launcher's
server folder is swept by the next launcher while a live one is kept."""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import pytest

from framework.distributed import process_start
from framework.distributed.process_start import (
    child_launch,
    child_process,
    multiproc_method,
    process_context,
    sweep_stale_server_dirs,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is the Linux default")


def report(name: str) -> None:
    """Child: print its view of the world (environment variable ``name``, its parent's pid, whether it still holds
    a fork server's "alive" descriptor, which would keep that server and so itself alive after the launcher died)."""
    from multiprocessing import forkserver

    held = forkserver._forkserver._forkserver_alive_fd is not None
    print(f"child saw {name}={os.environ.get(name)!r} ppid={os.getppid()} holds_server={held}", flush=True)


def test_method_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(process_start.MULTIPROC_METHOD_ENV, "spawn")
    assert multiproc_method() == "spawn" and process_context().get_start_method() == "spawn"
    monkeypatch.setenv(process_start.MULTIPROC_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match="forkserver, spawn"):
        multiproc_method()
    monkeypatch.delenv(process_start.MULTIPROC_METHOD_ENV)
    assert multiproc_method() == ("forkserver" if sys.platform.startswith("linux") else "spawn")


@linux_only
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_child_takes_the_environment_and_streams_of_now(method: str, monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """A variable set after the fork server started reaches the child, and so does its output (the test's
    captured descriptors); the child's parent is the pid :func:`child_launch` names."""
    monkeypatch.setenv(process_start.MULTIPROC_METHOD_ENV, method)
    ctx = process_context()
    launch = child_launch(ctx)  # under forkserver: the server runs from here on, with the environment of now
    monkeypatch.setenv("SERVELAB_TEST_LATE_VARIABLE", f"set-late-{method}")
    proc = child_process(ctx, report, args=("SERVELAB_TEST_LATE_VARIABLE",), name="report")
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    out = capfd.readouterr().out
    assert f"child saw SERVELAB_TEST_LATE_VARIABLE='set-late-{method}' ppid={launch.parent_pid} holds_server=False" in out
    assert launch.started_by_main_thread


@linux_only
def test_sweep_removes_only_unbound_server_folders(tmp_path) -> None:
    stale, live, other = (tmp_path / f"pymp-{n}" for n in ("stale", "live", "other"))
    for folder in (stale, live, other):
        folder.mkdir()
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(stale / "listener-a"))  # bound, then closed: what a dead server leaves
    (other / "listener-b").write_text("")
    (other / "something-else").write_text("")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(live / "listener-c"))
        server.listen()
        removed = sweep_stale_server_dirs(str(tmp_path))
        assert removed == [str(stale)]
        assert live.exists() and other.exists() and not stale.exists()


LAUNCHER = """
import sys, time
from framework.distributed.process_start import child_launch, child_process, process_context

if __name__ == "__main__":
    ctx = process_context()
    launch = child_launch(ctx)
    child = child_process(ctx, time.sleep, args=(120,), name="sleeper")
    child.start()
    print(launch.parent_pid, child.pid, flush=True)
    time.sleep(120)
"""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a stopped parent cannot reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@linux_only
def test_a_child_dies_with_its_launcher_even_while_the_fork_server_cannot_exit(tmp_path) -> None:
    """The launcher is SIGKILLed while its fork server is stopped (so the server cannot exit and take its children
    along): the child still exits, through its launcher's pidfd."""
    import signal
    import subprocess
    import time

    from helpers import REPO

    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    env = {**os.environ, process_start.MULTIPROC_METHOD_ENV: "forkserver", "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    server = child = None
    try:
        server, child = (int(x) for x in launcher.stdout.readline().split())
        assert _running(child)
        os.kill(server, signal.SIGSTOP)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the child outlived its launcher"
    finally:
        launcher.kill()
        for pid, sig in ((child, signal.SIGKILL), (server, signal.SIGKILL), (server, signal.SIGCONT)):
            if pid is not None:  # nothing left, pass or fail
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while server is not None and _running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        sweep_stale_server_dirs()  # the SIGKILLed launcher's pymp-* folder
