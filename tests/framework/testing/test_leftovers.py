"""The leftover check the fault tests and the matrix use: a name new in /dev/shm counts only while no live process
uses it (a live named semaphore included, whose mapping glibc shows under another, deleted name), and a zombie
is not a running process."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys

import pytest

from framework.testing.leftovers import live_pids, new_shm_names, shm_snapshot, wait_for_nothing_left

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/shm are Linux's")


@pytest.mark.isolated  # compares the whole of /dev/shm
def test_a_name_in_use_is_not_a_leftover_and_an_unused_one_is():
    before = shm_snapshot()
    live = mp.get_context("spawn").Semaphore(0)  # a named POSIX semaphore this process maps
    fake = f"servelab_test_leftover_{os.getpid()}"
    with open(f"/dev/shm/{fake}", "wb") as f:
        f.write(b"\0" * 64)
    try:
        assert new_shm_names(before) == [fake]  # the semaphore is live, the file nobody's
        assert wait_for_nothing_left(before, [], within_s=0.2) == ([], [fake])
    finally:
        os.unlink(f"/dev/shm/{fake}")
    assert new_shm_names(before) == []
    del live


def test_a_zombie_does_not_run():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while live_pids([child.pid]):  # exits, stays a zombie until reaped
        pass
    assert live_pids([os.getpid(), child.pid]) == [os.getpid()]
    child.wait()
