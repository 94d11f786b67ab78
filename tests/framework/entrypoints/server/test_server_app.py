"""The FastAPI app in-process (httpx ASGI transport, one stories260K engine for the module): every bad
request gets its status and OpenAI error body and the engine keeps serving; auth on/off; chat with and
without a chat template; structured output via response_format/structured_outputs."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import STORIES, assert_all_blocks_free  # noqa: E402

from framework.core.sampling_params import SamplingParams  # noqa: E402
from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def setup():
    from framework import LLM

    engine = LLM(model=STORIES, num_blocks=128).engine  # owned by the AsyncLLM thread from now on
    oracle = LLM(model=STORIES, num_blocks=64)  # offline reference, its own engine
    async_llm = AsyncLLM(engine)
    state = ServerState(llm=async_llm, model_name="tiny", max_model_len=engine.max_model_len,
                        vocab_size=engine.vocab_size, tokenizer=engine.tokenizer,
                        supports_structured_outputs=engine.structured_output is not None)
    yield oracle, state
    async_llm.shutdown()
    assert_all_blocks_free(engine)


def _call(state: ServerState, method: str, path: str, body=None, headers=None, content=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.request(method, path, json=body, headers=headers, content=content)

    return asyncio.run(go())


def _assert_error(resp: httpx.Response, status: int, param: str | None = None, text: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and text in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def _ok(state: ServerState) -> None:
    resp = _call(state, "POST", "/v1/completions", {"model": "tiny", "prompt": "Once upon", "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("body, param, text", [
    ({"prompt": "a", "max_tokens": "ten"}, "max_tokens", "max_tokens"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", ""),
    ({"prompt": 5}, None, "prompt"),
    ({"max_tokens": 3}, "prompt", "prompt"),
    ({"prompt": "a", "bogus_field": 1}, "bogus_field", "bogus_field"),
    ({"prompt": "a", "top_p": 0.0}, None, "top_p"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "echo"),
    ({"prompt": "a", "logprobs": 99}, "logprobs", ""),
    ({"prompt": [], "max_tokens": 2}, "prompt", "empty"),
    ({"prompt": [1, 9999]}, "prompt", "[0, 512)"),
    ({"prompt": "a", "echo": True, "max_tokens": -1}, "max_tokens", ""),
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of", "best_of"),
    ({"prompt": "a", "best_of": 2, "stream": True}, "best_of", "stream"),
    ({"prompt": "a", "response_format": {"type": "yaml"}}, "response_format", "response_format"),
])
def test_bad_completion_requests_are_400_and_engine_stays_up(setup, body, param, text):
    _, state = setup
    _assert_error(_call(state, "POST", "/v1/completions", body), 400, param, text)
    _ok(state)


def test_malformed_json_unknown_model_and_context_limit(setup):
    _, state = setup
    resp = _call(state, "POST", "/v1/completions", content=b'{"prompt": "a",', headers={"content-type": "application/json"})
    assert "malformed JSON" in _assert_error(resp, 400)["message"]
    err = _assert_error(_call(state, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "a"}), 404)
    assert err == {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": None,
                   "code": 404}  # vLLM's body
    err = _assert_error(_call(state, "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 100000}), 400,
                        "max_tokens", str(state.max_model_len))
    assert err["code"] == "context_length_exceeded"
    _assert_error(_call(state, "GET", "/v1/nothing"), 404)
    _ok(state)


def test_chat_without_template_is_400_then_with_template_matches_offline(setup):
    llm, state = setup
    messages = [{"role": "user", "content": "Tell me a story"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    err = _assert_error(_call(state, "POST", "/v1/chat/completions", body), 400, "messages", "chat template")
    assert err["code"] == "no_chat_template"
    templated = ServerState(**{**state.__dict__, "chat_template": TEMPLATE})
    resp = _call(templated, "POST", "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    ids = llm.get_tokenizer()("user: Tell me a story\nassistant:", add_special_tokens=False).input_ids
    want = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out["choices"][0]["message"]["content"] == want.outputs[0].text
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want.outputs[0].token_ids),
                            "total_tokens": len(ids) + len(want.outputs[0].token_ids)}
    bad_part = {**body, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    _assert_error(_call(templated, "POST", "/v1/chat/completions", bad_part), 400, "messages", "text")


def test_auth_on_and_off(setup):
    _, state = setup
    locked = ServerState(**{**state.__dict__, "api_key": "s3cret"})
    body = {"prompt": "Once", "max_tokens": 2}
    assert _assert_error(_call(locked, "POST", "/v1/completions", body), 401)["code"] == "invalid_api_key"
    _assert_error(_call(locked, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    good = _call(locked, "POST", "/v1/completions", body, headers={"Authorization": "Bearer s3cret"})
    assert good.status_code == 200
    assert _call(locked, "GET", "/health").status_code == 200  # health/metrics/version need no key
    assert _call(state, "GET", "/v1/models").json()["data"][0]["id"] == "tiny"  # auth off


def test_n_choices_logprobs_and_streamed_deltas(setup):
    llm, state = setup
    body = {"prompt": ["Once upon a time", "Lily"], "n": 2, "max_tokens": 6, "temperature": 0.0, "logprobs": 2,
            "ignore_eos": True}
    out = _call(state, "POST", "/v1/completions", body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3] and out["usage"]["completion_tokens"] == 24
    assert out["choices"][0]["text"] == out["choices"][1]["text"]  # greedy: identical choices
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(len(t) <= 2 for t in lp["top_logprobs"])
    assert all(v <= 0.0 for v in lp["token_logprobs"]) and "".join(lp["tokens"]) == out["choices"][0]["text"]
    resp = _call(state, "POST", "/v1/completions", {**body, "logprobs": None, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 24
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"][0]["index"] == i)
             for i in range(4)}
    assert [texts[i] for i in range(4)] == [c["text"] for c in out["choices"]]


def test_structured_output_choice(setup):
    _, state = setup
    if not state.supports_structured_outputs:
        pytest.skip("engine built with grammar=none")
    body = {"prompt": "Once", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    out = _call(state, "POST", "/v1/completions", body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] in ("yes", "no")
    _assert_error(_call(state, "POST", "/v1/completions",
                        {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}), 400)


def test_stop_strings_seed_and_chat_logprobs(setup):
    llm, state = setup
    base = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.0}
    full = _call(state, "POST", "/v1/completions", base).json()["choices"][0]["text"]
    word = full.split()[2]
    out = _call(state, "POST", "/v1/completions", {**base, "stop": [word]}).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == word and word not in out["text"]
    assert full.startswith(out["text"])
    seeded = {**base, "temperature": 1.0, "seed": 7}
    first, second = (_call(state, "POST", "/v1/completions", seeded).json()["choices"][0]["text"] for _ in range(2))
    assert first == second
    templated = ServerState(**{**state.__dict__, "chat_template": TEMPLATE})
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 3, "ignore_eos": True}
    choice = _call(templated, "POST", "/v1/chat/completions", body).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 3 for c in content)
    # tokens are decoded in context; the engine's text drops the first token's SentencePiece space
    assert "".join(c["token"] for c in content).lstrip() == choice["message"]["content"].lstrip()
    assert all(c["logprob"] == max(t["logprob"] for t in c["top_logprobs"]) for c in content)  # greedy = argmax


def test_logit_bias(setup):
    """OpenAI's logit_bias (token ids as strings): +100 forces a token; a key that is no token id is a 400."""
    _, state = setup
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0.0, "logit_bias": {"400": 100}}
    out = _call(state, "POST", "/v1/completions", body)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == state.tokenizer.decode([400, 400, 400])
    for bad in ({"x": 1.0}, {"9999": 1.0}, {"-3": 1.0}):
        _assert_error(_call(state, "POST", "/v1/completions", {**body, "logit_bias": bad}), 400, "logit_bias")
    _assert_error(_call(state, "POST", "/v1/completions", {**body, "logit_bias": {"5": 500.0}}), 400, None, "logit_bias")


def test_health_is_503_compiling_until_the_start_up_is_done():
    """A server's start-up work (its compile warm-up) runs on the loop thread: ``/health`` answers 503
    with a "compiling" reason meanwhile, a request sent then waits and is served, and ``/health`` is
    200 after it (vLLM's readiness behaviour)."""
    import threading

    from framework import LLM

    engine = LLM(model=STORIES, num_blocks=32).engine
    release = threading.Event()
    llm = AsyncLLM(engine, startup=lambda: release.wait(60))
    state = ServerState(llm=llm, model_name="tiny", max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                        tokenizer=engine.tokenizer, supports_structured_outputs=False)

    async def go():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            starting = await client.get("/health")
            request = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3}))
            await asyncio.sleep(0.2)
            assert not request.done()  # waits for the start-up
            release.set()
            return starting, await request, await client.get("/health")

    try:
        starting, completion, ready = asyncio.run(go())
    finally:
        llm.shutdown()
    _assert_error(starting, 503, text="compiling")
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 3
    assert ready.status_code == 200 and llm.ready and llm.startup_s > 0
    assert_all_blocks_free(engine)


def test_engine_down_is_503(setup):  # last: shuts the module's engine loop down
    _, state = setup
    state.llm.shutdown()
    _assert_error(_call(state, "GET", "/health"), 503)
    _assert_error(_call(state, "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 2}), 503)
