"""SmolLM2 (byte-level BPE, real chat template) through the app in-process: chat completions streamed and
not streamed give the same text, equal to the offline engine on the template-rendered prompt."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from helpers import assert_all_blocks_free  # noqa: E402

from framework.core.sampling_params import SamplingParams  # noqa: E402
from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Write a haiku about snow. Use an emoji: ❄️"]


def _post(app, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300) as c:
            return await c.post("/v1/chat/completions", json=body)

    return asyncio.run(go())


def test_smollm2_chat_stream_equals_non_stream_equals_offline(make_llm):
    from framework.model_executor.model_loader import resolve_model_path

    llm = make_llm(model=resolve_model_path("smollm2"), dtype="float32", max_model_len=512)
    engine, tok = llm.engine, llm.get_tokenizer()
    async_llm = AsyncLLM(engine)
    state = ServerState(llm=async_llm, model_name="smollm2", max_model_len=engine.max_model_len,
                        vocab_size=engine.vocab_size, tokenizer=tok, supports_structured_outputs=False)
    app = build_app(state)
    served = []
    try:
        for question in QUESTIONS:
            body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": 24,
                    "temperature": 0.0}
            full = _post(app, body).json()["choices"][0]["message"]["content"]
            events = [e[len("data: "):] for e in _post(app, {**body, "stream": True}).text.split("\n\n") if e]
            assert events[-1] == "[DONE]"
            streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
            assert streamed == full
            served.append(full)
    finally:
        async_llm.shutdown()  # the engine is free again for the offline reference below
    for question, text in zip(QUESTIONS, served):
        rendered = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=False)
        ids = tok(rendered, add_special_tokens=False).input_ids
        want = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert text == want.outputs[0].text
    assert_all_blocks_free(engine)
