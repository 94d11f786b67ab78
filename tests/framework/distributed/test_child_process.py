"""A child dies with its parent at any moment: the kernel's parent-death signal kills it at once (its watcher
set to wait a minute here, so only the signal can be that fast), the watcher thread alone within a second,
and a child started from a thread that has ended lives on while its parent process lives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import REPO

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, sys, threading, time
    sys.path.insert(0, {repo!r})
    from framework.distributed import child_process as parent_death

    def child(parent_pid, main_thread, check_s):
        parent_death.PARENT_CHECK_S = check_s
        parent_death.die_with_parent(parent_pid, main_thread)
        print("ARMED", flush=True)
        while True:
            sum(range(10_000))  # busy on its main thread, as a compile is

    if __name__ == "__main__":
        how, ctx, box = sys.argv[1], mp.get_context("spawn"), []
        def start(check_s):
            box.append(ctx.Process(target=child, args=(os.getpid(), parent_death.spawned_by_main_thread(), check_s)))
            box[0].start()
        if how == "thread":  # started by a thread that ends right after
            thread = threading.Thread(target=start, args=(0.5,))
            thread.start()
            thread.join()
        else:
            start({{"signal": 60.0, "watcher": 0.5}}[how])
        print(box[0].pid, flush=True)
        time.sleep(3600)
""")


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("how, within_s", [("signal", 1.0), ("watcher", 2.0), ("thread", 2.0)])
def test_a_child_dies_with_its_parent(tmp_path, how, within_s):
    script = tmp_path / "parent.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    parent = subprocess.Popen([sys.executable, str(script), "signal" if how == "signal" else how],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "ARMED"
        if how == "thread":  # the starting thread ended long ago: no parent-death signal was armed for it
            time.sleep(1.5)
            assert not _gone(child)
        parent.kill()
        parent.wait(10)
        t0 = time.monotonic()
        while not _gone(child) and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert _gone(child) and time.monotonic() - t0 < within_s, time.monotonic() - t0
    finally:
        parent.kill()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_no_library_lock_is_a_named_semaphore_in_a_spawned_child(tmp_path):
    """In a spawned process the default context is ``spawn``: tqdm's first bar made a ``multiprocessing.RLock``,
    a ``/dev/shm/sem.mp-*`` that only the resource tracker removed (a killed server's engine core left it)."""
    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, sys
        sys.path.insert(0, {str(REPO)!r})
        from framework.distributed.child_process import avoid_named_semaphores
        mp.set_start_method("spawn")  # as in a spawned child
        if sys.argv[1] == "avoid":
            avoid_named_semaphores()
        from tqdm import tqdm
        for _ in tqdm(range(2), disable=False):
            pass
        print(["named" for lock in tqdm.get_lock().locks if getattr(getattr(lock, "_semlock", None), "name", None)])
    """))
    run = [subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
           for how in ("avoid", "default")]
    assert [r.stdout.strip() for r in run] == ["[]", "['named']"], [r.stderr[-2000:] for r in run]
