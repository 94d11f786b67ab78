"""``servelab serve parallel.tensor_parallel_size=2 executor=mp`` as a user starts it (``run.py
mode=serve`` subprocess, stories260K sharded over two worker processes): a greedy completion equals
the offline engine's; killing one worker fails the in-flight request with a 503 and the server exits
non-zero within seconds, leaving no worker process and no ``/dev/shm`` name its processes mapped (the step
ring is a memfd, which has none)."""

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
from helpers import (  # noqa: E402
    EAGER_KERNEL,
    REPO,
    STORIES,
    STORY_PROMPTS,
    free_port,
    mapped_shm,
    memfd_mapped,
    resources_gone,
    servelab_processes,
    wait_healthy,
)


@pytest.mark.slow
def test_tp2_server_serves_then_exits_nonzero_when_a_worker_dies(tmp_path):
    from framework import LLM, SamplingParams

    port = free_port()
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "parallel.tensor_parallel_size=2",
           "executor=mp", "engine.compile=false", EAGER_KERNEL, f"server.port={port}", "tracker=none",
           "server.log_level=warning", f"hydra.run.dir={tmp_path / 'run'}"]
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log)
        resp = httpx.post(base + "/v1/completions", timeout=60,
                          json={"prompt": STORY_PROMPTS[0], "max_tokens": 12, "temperature": 0.0}).json()
        want = LLM(model=STORIES, max_model_len=192).generate([STORY_PROMPTS[0]],
                                                              SamplingParams(temperature=0.0, max_tokens=12))
        assert resp["choices"][0]["text"] == want[0].outputs[0].text
        cores = servelab_processes(proc.pid, "servelab-core")
        assert len(cores) == 1  # the engine core process, whose executor started the two ranks
        workers = servelab_processes(cores[0].pid, "servelab-rank")
        assert len(workers) == 2
        # the step ring is a memfd (no /dev/shm name at any moment): every rank maps it; the /dev/shm names
        # these processes map (none expected; other tests' may come and go meanwhile) must be gone after
        assert all(memfd_mapped(w.pid) for w in workers), "a worker maps no memfd step ring"
        segments = mapped_shm([proc.pid, cores[0].pid] + [w.pid for w in workers])
        statuses: list[int] = []
        inflight = threading.Thread(target=lambda: statuses.append(httpx.post(
            base + "/v1/completions", timeout=60,
            json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True}).status_code))
        inflight.start()
        time.sleep(1.0)
        os.kill(workers[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert proc.wait(30) != 0
        assert time.monotonic() - t0 < 10
        inflight.join(30)
        assert statuses == [503]
        assert resources_gone([w.pid for w in workers], sorted(segments))
        log.seek(0)
        assert "lost a worker: worker rank 1" in log.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
