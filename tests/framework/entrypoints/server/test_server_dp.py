"""``servelab serve parallel.data_parallel_size=2 router=round_robin executor=mp`` as a user starts it (``run.py
mode=serve`` subprocess, two stories260K replicas, each with its own worker process), driven by the official
``openai`` client: concurrent greedy completions equal the offline engine's and are answered once each,
``/metrics`` shows each replica's load; killing one replica's worker fails only the request it held (503 engine_dead), the
router stops choosing it, ``/health`` reports the degraded state, the other replica keeps serving, and shutdown
leaves no worker process."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
psutil = pytest.importorskip("psutil")
from helpers import (  # noqa: E402
    EAGER_KERNEL,
    REPO,
    STORIES,
    STORY_PROMPTS,
    free_port,
    resources_gone,
    servelab_processes,
    wait_healthy,
)

MODEL = "stories260K"  # the served model name (model.path of conf/model/stories260K.yaml)


def _routed(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'servelab:replica_num_requests_routed\{[^}]*replica="(\d)"\} ([0-9.]+)', text)}


@pytest.mark.slow
def test_two_replicas_serve_and_survive_one_replica_dying(tmp_path):
    from framework import LLM, SamplingParams

    port = free_port()
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "parallel.data_parallel_size=2",
           "router=round_robin", "executor=mp", "engine.compile=false", EAGER_KERNEL, f"server.port={port}", "tracker=none",
           "server.log_level=warning", f"hydra.run.dir={tmp_path / 'run'}"]
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        wait_healthy(proc, base, log)
        prompts = STORY_PROMPTS[:4] * 2
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                                                      temperature=0.0).choices[0].text, prompts))
        want = LLM(model=STORIES, compile=False).generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        assert texts == [w.outputs[0].text for w in want]
        assert _routed(base) == {"0": 4.0, "1": 4.0}
        cores = servelab_processes(proc.pid, "servelab-core")
        assert len(cores) == 2  # an engine-core process per replica, each pinned to its own CPUs
        if len(os.sched_getaffinity(0)) >= 2:
            assert not set(cores[0].cpu_affinity()) & set(cores[1].cpu_affinity())
        workers = [w for core in cores for w in servelab_processes(core.pid, "servelab-rank")]
        assert len(workers) == 2  # replica 0's rank, then replica 1's

        def long_request(_: int) -> str:
            try:
                client.completions.create(model=MODEL, prompt="Once", max_tokens=400, extra_body={"ignore_eos": True})
                return "ok"
            except openai.APIStatusError as exc:
                return str(exc.status_code)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            inflight = [pool.submit(long_request, i) for i in range(2)]  # round robin: one per replica
            time.sleep(1.5)
            os.kill(workers[1].pid, signal.SIGKILL)
            results = sorted(f.result(timeout=120) for f in inflight)
        assert results == ["503", "ok"]  # the dead replica's request: engine_dead, retryable
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["dead_replicas"] == [1]
        again = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0.0).choices[0].text
                 for p in prompts[:3]]
        assert again == [w.outputs[0].text for w in want[:3]]
        assert _routed(base)["1"] == 5.0 and proc.poll() is None
        assert 'servelab:replica_alive{model_name="' in httpx.get(base + "/metrics", timeout=10).text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
        log.close()
    assert proc.returncode == 0
    assert resources_gone([p.pid for p in cores + workers])
