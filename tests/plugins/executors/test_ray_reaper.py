"""The Ray reaper (``plugins.executors._ray_reaper``) without Ray: stand-in processes whose command line names a
made-up session are killed when the driver's pipe closes without ``done``, and left alone after a clean shutdown."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from plugins.executors._ray_reaper import reap, session_pids, session_tree, start_reaper, stop_reaper

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reaper reads /proc (Linux)")


def _made_up_session() -> str:
    """A name shaped like Ray's (``session_<date>_<time>_<us>_<pid>``) that no real session has."""
    return f"session_2099-01-01_00-00-00_{uuid.uuid4().int % 10**6}_{uuid.uuid4().int % 10**7}"


def test_a_name_that_is_not_a_ray_session_s_is_refused():
    """The reaper kills whatever names the session: a short or odd name would match unrelated processes."""
    for name in ("x", "", "session_", "python"):
        with pytest.raises(ValueError, match="not a Ray session name"):
            session_pids(name)
        assert start_reaper(name) is None


def _stand_ins(session: str, n: int = 2) -> list[subprocess.Popen]:
    """``n`` sleeping processes whose argv names ``session`` (as Ray passes --session-name to its processes)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"--session-name={session}"])
             for _ in range(n)]
    deadline = time.monotonic() + 10
    while len(session_pids(session)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs


def _stand_in_raylet(session: str) -> subprocess.Popen:
    """A process whose argv names ``session`` with one child whose argv names nothing (a raylet and an agent that
    renamed itself); returns once both are seen."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    raylet = subprocess.Popen([sys.executable, "-c", code, f"--session-name={session}"])
    deadline = time.monotonic() + 10
    while len(session_tree(session)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return raylet


def test_a_session_process_s_renamed_children_are_reaped_too():
    """Ray's agents and workers rename themselves (``ray::IDLE``): they are found as the raylet's descendants."""
    session = _made_up_session()
    raylet = _stand_in_raylet(session)
    try:
        tree = session_tree(session)
        assert raylet.pid in tree and len(tree) == 2  # the stand-in raylet and its child, whose argv names nothing
        assert sorted(reap(session)) == sorted(tree)
        assert raylet.wait(5) == -9
    finally:
        raylet.kill()


@pytest.fixture
def session_and_reaper():
    """A made-up session with two stand-in processes and its reaper: ``(procs, reaper)``; the stand-ins are
    killed after the test."""
    session = _made_up_session()
    procs = _stand_ins(session)
    assert {p.pid for p in procs} <= set(session_pids(session))
    yield procs, start_reaper(session)
    for p in procs:
        p.kill()
        p.wait(5)


def test_a_dead_driver_s_session_is_killed_within_a_second(session_and_reaper):
    procs, reaper = session_and_reaper
    reaper.stdin.close()  # what the kernel does when the driver dies
    t0 = time.monotonic()
    codes = [p.wait(5) for p in procs]
    assert codes == [-9, -9] and time.monotonic() - t0 < 1.0
    assert reaper.wait(5) == 0


def test_a_clean_shutdown_kills_nothing(session_and_reaper):
    procs, reaper = session_and_reaper
    stop_reaper(reaper)
    assert reaper.returncode == 0
    time.sleep(0.2)
    assert [p.poll() for p in procs] == [None, None]


def test_children_orphaned_before_the_driver_died_are_reaped_from_an_earlier_look():
    """The raylet dies with the driver, orphaning its agents (their parent is then init, their argv names nothing):
    the reaper kills them from the look it took while the driver lived."""
    session = _made_up_session()
    raylet = _stand_in_raylet(session)
    reaper = None
    try:
        agent = next(pid for pid in session_tree(session) if pid != raylet.pid)
        reaper = start_reaper(session)
        time.sleep(2.5)  # at least one look (LOOK_EVERY_S) with the tree whole
        raylet.kill()
        raylet.wait(5)
        assert agent not in session_tree(session)  # orphaned: nothing links it to the session any more
        reaper.stdin.close()
        assert reaper.wait(5) == 0
        deadline = time.monotonic() + 2
        while Path(f"/proc/{agent}").exists() and "State:\tZ" not in _status(agent) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{agent}").exists() or "State:\tZ" in _status(agent)
    finally:
        raylet.kill()
        if reaper is not None:
            reaper.kill()


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ"
