"""The real server as a user starts it (``python run.py mode=serve`` subprocess on a free loopback
port, stories260K), driven by the official ``openai`` client, sync and async: greedy outputs equal
the offline engine's, streamed deltas concatenate to the non-streamed text, 64 concurrent streams
with a third disconnecting early, ``/metrics`` parsing and moving, auth, graceful SIGTERM (exit 0).
One server for the whole module; every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from helpers import EAGER_KERNEL, REPO, STORIES, STORY_PROMPTS, free_port, wait_healthy  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

KEY = "test-key"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = STORY_PROMPTS[:4]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chat.jinja").write_text(TEMPLATE)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SERVELAB_API_KEY": KEY}
    # engine.compile=false: under the default (auto) a server compiles at start-up; not what this tests
    # the engine core runs in its own process (server.engine_process=true, the default); scheduler=priority: the
    # request's priority crosses the process boundary (equal priorities schedule first-come first-served)
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", "engine.compile=false", EAGER_KERNEL,
           f"server.port={port}", "tracker=none", "scheduler=priority",
           f"server.chat_template={tmp / 'chat.jinja'}", "server.log_level=warning", f"hydra.run.dir={tmp / 'run'}"]
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, log, timeout_s=180)
    yield {"base": base, "proc": proc, "log": log, "run_dir": tmp / "run"}
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    log.close()


@pytest.fixture(scope="module")
def offline():
    from framework import LLM, SamplingParams

    llm = LLM(model=STORIES, num_blocks=64)

    def generate(prompts, max_tokens, ignore_eos=False):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        return [o.outputs[0] for o in llm.generate(prompts, params)]

    generate.tokenizer = llm.get_tokenizer()
    return generate


def _client(server, **kw):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server["base"] + "/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("" if "finished_reason" not in sample.labels else
                                 f"[{sample.labels['finished_reason']}]")
            values[key] = values.get(key, 0.0) + sample.value
    return values


def test_models_and_unknown_model(server):
    client = _client(server)
    assert [m.id for m in client.models.list().data] == ["stories260K"]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="Once", max_tokens=2)
    assert info.value.status_code == 404 and "The model `nope` does not exist." in str(info.value)


def test_sync_completions_equal_offline_and_stream_concatenates(server, offline):
    client = _client(server)
    want = offline(PROMPTS, 16)
    resp = client.completions.create(model="stories260K", prompt=PROMPTS, max_tokens=16, temperature=0.0)
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert resp.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    for prompt, w in zip(PROMPTS, want):
        stream = client.completions.create(model="stories260K", prompt=prompt, max_tokens=16, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == w.text
        assert chunks[-1].usage.completion_tokens == len(w.token_ids)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == w.finish_reason


def test_sync_chat_equals_offline_on_rendered_prompt(server, offline):
    client = _client(server)
    ids = offline.tokenizer("user: Once upon a time\nassistant:", add_special_tokens=False).input_ids
    want = offline([{"prompt_token_ids": ids}], 12)[0]
    messages = [{"role": "user", "content": "Once upon a time"}]
    resp = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=12, temperature=0.0)
    assert resp.choices[0].message.content == want.text and resp.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model="stories260K", messages=messages, max_tokens=12,
                                                 temperature=0.0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_64_concurrent_streams_a_third_disconnect(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]  # every third (i % 3 == 0) disconnects; it asks for
    # 400 tokens so it cannot finish before its client leaves
    want = {p: w.text for p, w in zip(PROMPTS, offline(PROMPTS, 24, ignore_eos=True))}
    before = _metrics(server)

    async def one(client, i):
        stream = await client.completions.create(
            model="stories260K", prompt=prompts[i], max_tokens=400 if i % 3 == 0 else 24, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, n = "", None, 0
        async for chunk in stream:
            n += 1
            if i % 3 == 0 and n == 2:
                await stream.close()  # disconnect mid-stream
                return None
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*[one(client, i) for i in range(64)]), 300)

    results = asyncio.run(main())
    for i, result in enumerate(results):
        if i % 3:
            text, usage = result
            assert text == want[prompts[i]] and usage.completion_tokens == 24
    deadline = time.monotonic() + 60
    while True:
        after = _metrics(server)
        if after["servelab:kv_cache_usage_perc"] == 0 and after["servelab:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"KV not freed after disconnects: {after}"
        time.sleep(0.5)
    assert after["servelab:request_success_total[abort]"] - before.get("servelab:request_success_total[abort]", 0) == 22
    assert after["servelab:request_success_total[length]"] - before.get("servelab:request_success_total[length]", 0) == 42
    assert after["servelab:generation_tokens_total"] - before["servelab:generation_tokens_total"] >= 42 * 24
    assert after["servelab:time_to_first_token_seconds_count"] > before["servelab:time_to_first_token_seconds_count"]
    raw = httpx.post(server["base"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"prompt": "Once", "max_tokens": 3, "stream": True})
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_structured_output_and_priority_cross_the_engine_core_boundary(server):
    client = _client(server)
    choices = ["yes", "no", "maybe"]
    texts = [client.completions.create(model="stories260K", prompt=p, max_tokens=8, temperature=1.0, seed=i,
                                       extra_body={"structured_outputs": {"choice": choices}, "priority": -i}
                                       ).choices[0].text for i, p in enumerate(PROMPTS[:3])]
    assert all(t in choices for t in texts), texts
    with pytest.raises(openai.BadRequestError, match="priority"):  # checked API-side, before the core
        client.completions.create(model="stories260K", prompt=PROMPTS[0], max_tokens=2, extra_body={"priority": "high"})


def test_non_streaming_client_disconnect_aborts(server):
    before = _metrics(server).get("servelab:request_success_total[abort]", 0)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server["base"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5,
                   json={"prompt": "Once", "max_tokens": 480, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while _metrics(server).get("servelab:request_success_total[abort]", 0) < before + 1:
        assert time.monotonic() < deadline, "a non-streaming request was not aborted after its client left"
        time.sleep(0.2)
    assert _metrics(server)["servelab:kv_cache_usage_perc"] == 0


def test_auth_and_bad_requests_over_http(server):
    base = server["base"]
    resp = httpx.post(base + "/v1/completions", json={"prompt": "a"}, timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    resp = httpx.post(base + "/v1/completions", content=b"{not json", headers=headers, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).completions.create(model="stories260K", prompt="Once", max_tokens=5000)
    assert "512" in str(info.value)
    assert httpx.get(base + "/version", timeout=10).json()["version"]
    assert _client(server).completions.create(model="stories260K", prompt="Once", max_tokens=2).choices


def test_openai_client_echo_logprobs_max_tokens_0_and_n(server):
    """What lm-evaluation-harness and best-of-n users send, through the official client unchanged: the prompt's
    logprobs alone (``echo=True, logprobs=5, max_tokens=0``; the first token's is null) and ``n=3`` samples
    (distinct with a seed; the prompt's KV blocks computed once: the prefix-cache hit counter grows)."""
    client = _client(server)
    resp = client.completions.create(model="stories260K", prompt=PROMPTS[3], echo=True, logprobs=5, max_tokens=0)
    choice = resp.choices[0]
    assert choice.text == PROMPTS[3] and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == resp.usage.prompt_tokens
    assert all(5 <= len(top) <= 6 for top in lp.top_logprobs[1:])
    hits = _metrics(server).get("servelab:prefix_cache_hits_total", 0.0)
    resp = client.completions.create(model="stories260K", prompt=PROMPTS[3], n=3, seed=4, temperature=1.0,
                                     max_tokens=8, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2] and len({c.text for c in resp.choices}) == 3
    assert _metrics(server)["servelab:prefix_cache_hits_total"] - hits >= 2 * 16  # sequences 1, 2 hit the prompt


def test_bench_serving_smoke(server, tmp_path):
    import importlib.util

    path = REPO / "experiments" / "serving" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    record = bench.main(["--base-url", server["base"], "--model", "stories260K", "--api-key", KEY,
                         "--workload", "random", "workload.num_prompts=6", "workload.input_len_min=4",
                         "workload.input_len_max=8", "workload.output_len_min=3", "workload.output_len_max=5",
                         "--request-rate", "50", "--max-concurrency", "3", "--ignore-eos", "--goodput", "e2el:60000",
                         "--result-file", str(out)])
    assert record["completed"] == 6 and record["failed"] == 0 and record["request_goodput"] > 0
    assert record["output_lens"] == [int(n) for n in record["output_lens"]] and 18 <= sum(record["output_lens"]) <= 30
    assert {"mean_ttft_ms", "p99_itl_ms", "median_tpot_ms", "p90_e2el_ms"} <= set(record) and out.is_file()


def test_sigterm_aborts_in_flight_stream_and_exits_0(server):
    lines: list[str] = []

    def stream():
        with httpx.stream("POST", server["base"] + "/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while _metrics(server)["servelab:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server["proc"].send_signal(signal.SIGTERM)
    assert server["proc"].wait(60) == 0
    reader.join(60)
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "abort"' in lines[-2]
    assert (server["run_dir"] / "metrics.json").is_file()
