"""The Ray reaper (``plugins.executors._ray_reaper``) without Ray: stand-in processes whose command line names a
made-up session are killed when the driver's pipe closes without ``done``, and left alone after a clean shutdown."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from plugins.executors._ray_reaper import session_pids, start_reaper, stop_reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux)")


def _stand_ins(session: str, n: int = 2) -> list[subprocess.Popen]:
    """``n`` sleeping processes whose argv names ``session`` (as Ray passes --session-name to its processes)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--session-name={session}"])
             for _ in range(n)]
    deadline = time.monotonic() + 10
    while len(session_pids(session)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs


def test_a_dead_driver_s_session_is_killed_within_a_second():
    session = f"session_test_{uuid.uuid4().hex}"
    procs = _stand_ins(session)
    reaper = start_reaper(session)
    try:
        assert {p.pid for p in procs} <= set(session_pids(session))
        reaper.stdin.close()  # what the kernel does when the driver dies
        t0 = time.monotonic()
        codes = [p.wait(5) for p in procs]
        assert codes == [-9, -9] and time.monotonic() - t0 < 1.0
        assert reaper.wait(5) == 0
    finally:
        for p in procs:
            p.kill()


def test_a_clean_shutdown_kills_nothing():
    session = f"session_test_{uuid.uuid4().hex}"
    procs = _stand_ins(session)
    reaper = start_reaper(session)
    try:
        stop_reaper(reaper)
        assert reaper.returncode == 0
        time.sleep(0.2)
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for p in procs:
            p.kill()
            p.wait(5)
