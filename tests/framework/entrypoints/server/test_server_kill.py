"""A ``servelab serve`` ended by a signal leaves nothing behind: killed outright (SIGKILL of the API process: no
shutdown handler runs) while a request streams, and SIGTERMed while its engine core is still starting (before the
API process has a handler). The engine core dies with the API process (the kernel's parent-death signal, a watcher
thread armed before the build), its ``executor=mp`` worker with it, and no name the run created is left in
``/dev/shm`` (the folder compared before and after; a new name some live process uses belongs to a test running
at the same time and is not counted, so these run beside other tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")
from helpers import EAGER_KERNEL, REPO, free_port, servelab_processes, wait_healthy  # noqa: E402

from framework.testing.leftovers import shm_snapshot, wait_for_nothing_left  # noqa: E402


def _server(tmp_path, port: int, *overrides: str) -> tuple[subprocess.Popen, object]:
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "executor=mp", EAGER_KERNEL,
           f"server.port={port}", "tracker=none", "server.log_level=warning", f"hydra.run.dir={tmp_path / 'run'}",
           *overrides]
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - closed by the caller
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                            stderr=subprocess.STDOUT), log


@pytest.mark.slow
def test_a_killed_server_leaves_no_engine_core_worker_or_segment(tmp_path):
    port = free_port()
    before = shm_snapshot()
    proc, log = _server(tmp_path, port, "engine.compile=false")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log)
        cores = servelab_processes(proc.pid, "servelab-core")
        assert len(cores) == 1  # the engine core in its own process (server.engine_process=true, the default)
        workers = servelab_processes(cores[0].pid, "servelab-rank")
        assert len(workers) == 1  # executor=mp's rank
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]  # resource tracker too

        streaming = threading.Event()

        def stream() -> None:  # a request in flight when the server dies
            try:
                with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                        "model": "stories260K", "prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}) as resp:
                    for _ in resp.iter_lines():
                        streaming.set()
            except httpx.HTTPError:
                pass  # expected: the server is killed mid-stream

        inflight = threading.Thread(target=stream, daemon=True)
        inflight.start()
        assert streaming.wait(60), "the request never streamed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        inflight.join(30)
        assert wait_for_nothing_left(before, pids, within_s=10) == ([], [])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.mark.isolated  # a 10 s bound on the orphaned core's exit: alone under pytest-xdist
def test_a_server_sigtermed_while_its_core_starts_leaves_nothing(tmp_path):
    """SIGTERM before uvicorn runs (the API process has no handler yet, so it just ends) while the engine core
    builds its engine and would compile next (``engine.compile=true``). Before, the core went on building and
    compiling as an orphan at full CPU (its only parent check was on the input thread, after the build, and it
    compiled before reading the shutdown that check queued)."""
    before = shm_snapshot()
    proc, log = _server(tmp_path, free_port(), "engine.compile=true", "parallel.tensor_parallel_size=2")
    try:
        deadline, cores = time.monotonic() + 120, []
        while not cores and time.monotonic() < deadline and proc.poll() is None:
            cores = servelab_processes(proc.pid, "servelab-core")
            time.sleep(0.05)
        assert cores, "no engine core started"
        time.sleep(1.0)  # the core imports and builds
        pids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert wait_for_nothing_left(before, pids, within_s=10) == ([], [])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
