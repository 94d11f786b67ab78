"""A ``servelab serve`` killed outright (SIGKILL of the API process: no shutdown handler runs) leaves nothing behind:
its engine-core process notices that its parent is gone and shuts down, taking its ``executor=mp`` worker and the
shared-memory segments they mapped with it, while a request is streaming."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")
from helpers import EAGER_KERNEL, REPO, free_port, mapped_shm, resources_gone, wait_healthy  # noqa: E402


@pytest.mark.slow
def test_a_killed_server_leaves_no_engine_core_worker_or_segment(tmp_path):
    port = free_port()
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "executor=mp", "engine.compile=false",
           EAGER_KERNEL, f"server.port={port}", "tracker=none", "server.log_level=warning",
           f"hydra.run.dir={tmp_path / 'run'}"]
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log)
        cores = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(cores) == 1  # the engine core in its own process (server.engine_process=true, the default)
        workers = [w for w in cores[0].children() if "spawn_main" in " ".join(w.cmdline())]
        assert len(workers) == 1  # executor=mp's rank
        pids = [p.pid for p in cores + workers]
        segments = sorted(name for name in mapped_shm(pids) if name.startswith("psm_"))

        streaming = threading.Event()

        def stream() -> None:  # a request in flight when the server dies
            try:
                with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                        "model": "stories260K", "prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                        "stream": True}) as resp:
                    for _ in resp.iter_lines():
                        streaming.set()
            except httpx.HTTPError:
                pass

        inflight = threading.Thread(target=stream, daemon=True)
        inflight.start()
        assert streaming.wait(60), "the request never streamed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        inflight.join(30)
        # the core checks its parent every PARENT_CHECK_S; its shutdown stops the worker and unlinks the segments
        assert resources_gone(pids, segments, within_s=20), [p for p in pids if psutil.pid_exists(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
