"""A served simulated model: ``python run.py mode=serve executor=sim executor.params.clock=realtime`` answers the
official ``openai`` client (completions, streamed chat) with synthetic tokens at the predicted pace; a virtual
clock cannot serve and is refused before the port opens."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from helpers import REPO, free_port, wait_healthy
from sim_helpers import linear_profile

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

STEP_S = 0.02


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sim-serve")
    port = free_port()
    profile = linear_profile(tmp / "profile.json", STEP_S)
    (tmp / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "engine.compile=false", "executor=sim",
           "executor.params.clock=realtime", f"executor.params.profile={profile}", f"server.port={port}",
           "tracker=none", "server.log_level=warning", f"server.chat_template={tmp / 'chat.jinja'}",
           f"hydra.run.dir={tmp / 'run'}"]
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log, timeout_s=120)
    yield {"base": base, "run_dir": tmp / "run"}
    proc.terminate()
    try:
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0, timeout=60)


def test_completions_arrive_at_the_simulated_pace(server):
    start = time.perf_counter()
    out = _client(server).completions.create(model="stories260K", prompt="Once upon a time", max_tokens=10,
                                             extra_body={"ignore_eos": True})
    elapsed = time.perf_counter() - start
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"
    assert elapsed >= 10 * STEP_S  # each of the 10 steps slept its predicted 20 ms


def test_streamed_chat_and_metrics(server):
    stream = _client(server).chat.completions.create(
        model="stories260K", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    text = httpx.get(server["base"] + "/metrics", timeout=10).text
    assert "servelab:generation_tokens_total" in text


def test_a_virtual_clock_cannot_serve(tmp_path):
    profile = linear_profile(tmp_path / "profile.json")
    proc = subprocess.run([sys.executable, "run.py", "mode=serve", "model=stories260K", "executor=sim",
                           f"executor.params.profile={profile}", "tracker=none", f"server.port={free_port()}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "executor.params.clock=realtime" in proc.stderr
    assert "engine ready" not in proc.stderr  # refused from the config (Executor.wall_clock), before any engine core
