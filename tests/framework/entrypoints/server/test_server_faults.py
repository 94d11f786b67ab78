"""No request can take the server down (issue 34).

In-process (httpx ASGI transport): a random-weight model with the stories260K byte-fallback tokenizer sampled at
temperature 1.0 (the crash that turned ``servelab serve`` dead) serves concurrent streaming and non-streaming
requests; a request a plugin fails on gets a 500 with an OpenAI error body naming the plugin while the others
finish and ``/health`` stays 200.

Subprocess: a forward that raises (engine state unknown) answers 503 to the in-flight requests, turns
``/health`` to 503 and the process exits non-zero within seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import EAGER_KERNEL, REPO, STORY_PROMPTS, assert_all_blocks_free, free_port, wait_healthy  # noqa: E402

from framework import registry  # noqa: E402
from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402
from framework.testing import faulty_plugins  # noqa: E402
from framework.testing.faulty_plugins import FAULT_STOP  # noqa: E402


@pytest.fixture(scope="module")
def state(random_weight_stories):
    from framework import LLM

    with registry.registered(faulty_plugins, name="faulty-plugins"):
        engine = LLM(model=random_weight_stories, drafter="faulty").engine
        llm = AsyncLLM(engine)
        yield ServerState(llm=llm, model_name="tiny", max_model_len=engine.max_model_len,
                          vocab_size=engine.vocab_size, tokenizer=engine.tokenizer, supports_structured_outputs=True)
        llm.shutdown()
    assert_all_blocks_free(engine)


def _post_all(state: ServerState, bodies: list[dict]) -> list[httpx.Response]:
    async def go():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json=b) for b in bodies])

    return asyncio.run(go())


def test_byte_fallback_sampling_and_a_faulty_plugin_through_the_server(state):
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": i % 2 == 0,
               "logprobs": 1 if i % 3 == 0 else None} for i, p in enumerate(STORY_PROMPTS[:8])]
    poisoned = {"prompt": "The dog", "max_tokens": 40, "temperature": 0.0, "stop": [FAULT_STOP]}
    responses = _post_all(state, bodies[:4] + [poisoned, {**poisoned, "stream": True}] + bodies[4:])
    texts = []
    for body, resp in zip(bodies, responses[:4] + responses[6:]):
        assert resp.status_code == 200, resp.text
        if body["stream"]:
            events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), resp.text[-500:]
            chunks = [json.loads(e) for e in events[:-1]]
            texts.append("".join(c["choices"][0]["text"] for c in chunks))
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        else:
            choice = resp.json()["choices"][0]
            texts.append(choice["text"])
            assert choice["finish_reason"] == "length"
    assert any("\ufffd" in t for t in texts)  # invalid byte runs were sampled, and served
    error = responses[4].json()["error"]
    assert responses[4].status_code == 500 and error["type"] == "server_error" and error["code"] == "internal_error"
    assert "drafter 'faulty'" in error["message"]
    stream_error = [json.loads(e.removeprefix("data: ")) for e in responses[5].text.split("\n\n") if '"error"' in e]
    assert stream_error and "drafter 'faulty'" in stream_error[0]["error"]["message"]
    assert responses[5].text.rstrip().endswith("data: [DONE]")

    async def health():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return (await client.get("/health")).status_code

    assert asyncio.run(health()) == 200


# ---- engine death: a forward that raises, in a real server process -------------------------------------------
TRIGGER_ID = 400  # a forward whose input holds this token id 32 times or more raises
LAUNCHER = f"""
import sys
from framework.worker.model_runner import ModelRunner
forward = ModelRunner._forward
def dying_forward(self, input_ids, *args):
    if int((input_ids == {TRIGGER_ID}).sum()) >= 32:
        raise RuntimeError("injected forward fault")
    return forward(self, input_ids, *args)
ModelRunner._forward = dying_forward
if __name__ == "__main__":  # the engine-core process (spawned) re-imports this file as __mp_main__: patched too
    from framework.entrypoints.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_forward_fault_fails_in_flight_requests_and_exits_nonzero(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "server.log", "w+")
    launcher = tmp_path / "launch_dying.py"
    launcher.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(launcher), "model=stories260K", f"server.port={port}",
                             "tracker=none", "grammar=none", "server.log_level=warning", "engine.compile=false",  # not about compiling
                             EAGER_KERNEL,
                             f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, base, log)
        long = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True}
        results: dict[str, object] = {}

        def stream():
            with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                results["stream"] = [line for line in r.iter_lines() if line]

        def plain():
            results["plain"] = httpx.post(base + "/v1/completions", json=long, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # both are decoding
        killer = httpx.post(base + "/v1/completions", json={"prompt": [1] + [TRIGGER_ID] * 64, "max_tokens": 2},
                            timeout=60)
        t_dead = time.monotonic()
        for t in threads:
            t.join(60)
        assert killer.status_code == 503 and killer.json()["error"]["code"] == "engine_dead", killer.text
        assert "injected forward fault" in killer.json()["error"]["message"]
        assert results["plain"].status_code == 503, results["plain"].text
        assert results["stream"][-1] == "data: [DONE]" and "engine_dead" in results["stream"][-2]
        with contextlib.suppress(httpx.HTTPError):  # unless it already exited: /health is 503 meanwhile
            assert httpx.get(base + "/health", timeout=2).status_code == 503
        code = proc.wait(30)
        assert code != 0 and time.monotonic() - t_dead < 15, f"exit {code} after {time.monotonic() - t_dead:.1f} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
