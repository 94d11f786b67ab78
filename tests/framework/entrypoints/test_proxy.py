"""``servelab proxy``: two OpenAI servers (``kv_connector=shared_storage`` or ``zmq``, one ``kv_producer``, one
``kv_consumer`` with ``load_failure_policy=fail``) behind the P/D proxy, all in-process over httpx's ASGI transport.
Greedy float32 completions and chat completions, streamed and not, equal one plain engine's token for token (a
prompt shorter than one block included; SmolLM2's chat over zmq, slow); the decode server loaded the prefill's
blocks; a request whose KV fails to load gets an error naming the policy while the others are served; an abort while
the decode waits in WAITING_FOR_REMOTE_KVS (zmq) ends it at once and frees its blocks; the bodies the proxy sends are
vLLM's toy proxy's."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import STORIES, assert_all_blocks_free  # noqa: E402

from framework import LLM, SamplingParams  # noqa: E402
from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.proxy import PREFILL_KV_TRANSFER_PARAMS, build_proxy_app, decode_body, prefill_body  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402
from framework.interfaces.kv_connector import prefix_block_hashes  # noqa: E402

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # the proxy and KV transfer: eager attention kernel
BLOCK = 4
ENGINE = dict(model=STORIES, dtype="float32", compile=False, block_size=BLOCK, num_blocks=128, max_model_len=128)
LONG = "Once upon a time there was a little girl named Lily who loved to play in the park"
PROMPTS = [LONG, "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def _server(connector: str, path: Path, role: str) -> tuple[ServerState, object]:
    params = {"path": str(path)} if connector == "shared_storage" else {"abort_timeout_s": 60.0, "pull_timeout_s": 5.0}
    engine = LLM(**ENGINE, kv_connector=connector, kv_connector_params=params, kv_role=role,
                 kv_load_failure_policy="fail").engine
    state = ServerState(llm=AsyncLLM(engine), model_name="tiny", max_model_len=engine.max_model_len,
                        vocab_size=engine.vocab_size, tokenizer=engine.tokenizer, supports_structured_outputs=False,
                        chat_template=TEMPLATE)
    return state, engine


@pytest.fixture(scope="module", params=["shared_storage", "zmq"])
def pd(request, tmp_path_factory):
    """``(plain LLM, prefill state, decode state, decode engine, store folder)`` over one KV connector: the
    shared folder of ``shared_storage``, or ``zmq``'s pulls (the decode waits in WAITING_FOR_REMOTE_KVS)."""
    path = tmp_path_factory.mktemp("kv_store")
    prefill, prefill_engine = _server(request.param, path, "kv_producer")
    decode, decode_engine = _server(request.param, path, "kv_consumer")
    yield LLM(**ENGINE), prefill, decode, decode_engine, path
    for state, engine in ((prefill, prefill_engine), (decode, decode_engine)):
        state.llm.shutdown()
        assert_all_blocks_free(engine)


def _proxy_call(prefill: ServerState, decode: ServerState, path: str, body: dict) -> httpx.Response:
    async def go():
        mounts = {"http://prefill": httpx.ASGITransport(app=build_app(prefill)),
                  "http://decode": httpx.ASGITransport(app=build_app(decode))}
        async with httpx.AsyncClient(mounts=mounts, timeout=60) as backends:
            proxy = build_proxy_app(["http://prefill"], ["http://decode"], client=backends)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy), base_url="http://proxy",
                                         timeout=60) as client:
                return await client.post(path, json=body)

    return asyncio.run(go())


def _call(state: ServerState, path: str, body: dict) -> httpx.Response:
    """``body`` straight to one server (no proxy)."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://s",
                                     timeout=60) as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def _sse_text(resp: httpx.Response, key: str) -> str:
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", resp.text
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), resp.text
    return "".join(c["choices"][0]["text"] if key == "text" else c["choices"][0]["delta"].get("content", "")
                   for c in chunks if c["choices"])


def test_bodies_are_the_toy_proxys():
    body = {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    first = prefill_body(body)
    assert first == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                     "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
    handle = {"remote_block_ids": [3, 4], "do_remote_prefill": True}
    assert decode_body(body, {"kv_transfer_params": handle}) == {**body, "kv_transfer_params": handle}
    assert decode_body(body, {"kv_transfer_params": None}) == body
    with pytest.raises(ValueError, match="--prefill"):
        build_proxy_app([], ["http://decode"])


def test_completions_through_the_proxy_equal_one_plain_engine(pd):
    plain, prefill, decode, decode_engine, _ = pd
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))]
    for prompt, text in zip(PROMPTS, expected):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        resp = _proxy_call(prefill, decode, "/v1/completions", body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == text and resp.json()["usage"]["completion_tokens"] == 8
    streamed = _proxy_call(prefill, decode, "/v1/completions", {"model": "tiny", "prompt": PROMPTS[1] + " again",
                                                                 "max_tokens": 8, "temperature": 0, "stream": True})
    assert streamed.status_code == 200
    [again] = plain.generate([PROMPTS[1] + " again"], SamplingParams(temperature=0, max_tokens=8))
    assert _sse_text(streamed, "text") == again.outputs[0].text
    # the decode server computed none of the full prompt blocks the prefill server stored: it loaded them
    assert decode_engine.scheduler.kv_transfer.external_prefix_cache_hits > 0


def test_chat_streamed_through_the_proxy_equals_one_plain_engine(pd):
    plain, prefill, decode, _, _ = pd
    messages = [{"role": "user", "content": "Lily and the cat went to the park"}]
    ids = plain.engine.tokenizer(plain.engine.tokenizer.apply_chat_template(
        messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
    [want] = plain.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6))
    for stream in (False, True):
        resp = _proxy_call(prefill, decode, "/v1/chat/completions",
                           {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": stream})
        assert resp.status_code == 200, resp.text
        got = _sse_text(resp, "delta") if stream else resp.json()["choices"][0]["message"]["content"]
        assert got == want.outputs[0].text


def test_a_failed_kv_load_fails_only_that_request(pd):
    plain, prefill, decode, decode_engine, path = pd
    if decode_engine.config.kv_connector != "shared_storage":
        pytest.skip("a corrupted stored block is shared_storage's failure (zmq's: tests/plugins/kv_connectors)")
    prompt = "The dog and the bird sang a song under the big green tree"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    warm = _call(prefill, "/v1/completions", prefill_body(body))  # prefill only: files stored
    assert warm.status_code == 200 and warm.json()["kv_transfer_params"] is None  # shared_storage needs no handle
    key = prefix_block_hashes(plain.engine.tokenizer(prompt).input_ids, BLOCK)[1]
    (path / f"{key}.safetensors").write_bytes(b"not a safetensors file")
    failed = _proxy_call(prefill, decode, "/v1/completions", body)
    assert failed.status_code >= 400
    assert "load_failure_policy=fail" in failed.json()["error"]["message"]
    ok = _proxy_call(prefill, decode, "/v1/completions", {**body, "prompt": "Tom and Lily ate a cake"})
    [want] = plain.generate(["Tom and Lily ate a cake"], SamplingParams(temperature=0, max_tokens=4))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want.outputs[0].text


def test_an_abort_while_waiting_for_remote_kvs_frees_the_decode(pd):
    plain, prefill, decode, decode_engine, _ = pd
    if decode_engine.config.kv_connector != "zmq":
        pytest.skip("shared_storage loads synchronously: no request waits for remote KV")
    prompt = "Lily saw a big cat and the cat ran up the tall tree"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    handle = _call(prefill, "/v1/completions", prefill_body(body)).json()["kv_transfer_params"]
    assert handle["do_remote_prefill"] and handle["remote_block_ids"]
    silent = socket.create_server(("127.0.0.1", 0))  # accepts the pull's connection and never answers it
    parked = decode_engine.scheduler.kv_transfer.parked

    async def abort_while_parked() -> bool:
        stuck = {**handle, "remote_port": silent.getsockname()[1]}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(decode)), base_url="http://d",
                                     timeout=60) as client:
            task = asyncio.ensure_future(client.post("/v1/completions", json={**body, "kv_transfer_params": stuck}))
            deadline = time.monotonic() + 30
            while not parked and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            seen = bool(parked)
            task.cancel()  # the client goes away: the server aborts the parked request
            await asyncio.gather(task, return_exceptions=True)
            return seen

    try:
        assert asyncio.run(abort_while_parked()), "the decode request never waited in WAITING_FOR_REMOTE_KVS"
        deadline = time.monotonic() + 2  # well before the pull's own 5 s timeout: the abort ended it
        while decode_engine.scheduler.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not decode_engine.scheduler.requests and not parked
        deadline = time.monotonic() + 30  # its blocks wait for the pull in flight to end (delay_free), then free
        while decode_engine.scheduler.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not decode_engine.scheduler.has_unfinished_requests()
        assert_all_blocks_free(decode_engine)
    finally:
        silent.close()
    # the real handle is still served (the producer's held blocks are pulled and freed), token-exact
    resp = _call(decode, "/v1/completions", {**body, "kv_transfer_params": handle})
    [want] = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == want.outputs[0].text


@pytest.mark.slow
def test_smollm2_chat_through_the_proxy_over_zmq_equals_one_plain_engine():
    from framework.model_executor.model_loader import resolve_model_path

    engine = dict(model=resolve_model_path("smollm2"), dtype="float32", compile=False, max_model_len=512)
    states = []
    for role in ("kv_producer", "kv_consumer"):
        e = LLM(**engine, kv_connector="zmq", kv_connector_params={"abort_timeout_s": 60.0}, kv_role=role).engine
        states.append((ServerState(llm=AsyncLLM(e), model_name="smollm2", max_model_len=e.max_model_len,
                                   vocab_size=e.vocab_size, tokenizer=e.tokenizer, supports_structured_outputs=False),
                       e))
    (prefill, _), (decode, decode_engine) = states
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
    try:
        resp = _proxy_call(prefill, decode, "/v1/chat/completions",
                           {"model": "smollm2", "messages": messages, "max_tokens": 16, "temperature": 0})
    finally:
        for state, _ in states:
            state.llm.shutdown()
    assert resp.status_code == 200, resp.text
    assert decode_engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
    for _, e in states:
        assert_all_blocks_free(e)
    plain = LLM(**engine)
    tok = plain.get_tokenizer()
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
              add_special_tokens=False).input_ids
    [want] = plain.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=16))
    assert resp.json()["choices"][0]["message"]["content"] == want.outputs[0].text
