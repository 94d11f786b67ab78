"""Serving x speculative decoding x structured outputs: a server whose engine speculates (ngram) and
has a grammar engine answers unconstrained and constrained (``response_format`` JSON schema, regex)
requests, streaming and not, with greedy text equal to the offline non-speculative engine's and every
constrained output valid; the KV pool is empty afterwards."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from grammar_helpers import REGEX, SCHEMA, check_output  # noqa: E402
from helpers import STORIES, STORY_PROMPTS, assert_all_blocks_free  # noqa: E402

from framework import SamplingParams, StructuredOutputsParams  # noqa: E402
from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402


def test_server_with_spec_decode_and_grammar():
    from framework import LLM

    engine = LLM(model=STORIES, num_blocks=128, grammar="xgrammar", drafter="ngram",
                 drafter_params={"num_speculative_tokens": 3}).engine
    oracle = LLM(model=STORIES, num_blocks=128, grammar="xgrammar")  # no speculation
    async_llm = AsyncLLM(engine)
    state = ServerState(llm=async_llm, model_name="tiny", max_model_len=engine.max_model_len,
                        vocab_size=engine.vocab_size, tokenizer=engine.tokenizer, supports_structured_outputs=True)
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0.0} for p in STORY_PROMPTS[:3]]
    bodies += [{"prompt": STORY_PROMPTS[0], "max_tokens": 200, "temperature": 0.0, "response_format": schema},
               {"prompt": STORY_PROMPTS[1], "max_tokens": 200, "temperature": 0.0, "structured_outputs": {"regex": REGEX}}]

    async def run():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            plain = await asyncio.gather(*(client.post("/v1/completions", json={**b, "model": "tiny"}) for b in bodies))
            streamed = await asyncio.gather(*(client.post("/v1/completions", json={**b, "model": "tiny", "stream": True})
                                              for b in bodies))
        return plain, streamed

    try:
        plain, streamed = asyncio.run(run())
    finally:
        async_llm.shutdown()
    texts = []
    for resp, sresp in zip(plain, streamed):
        assert resp.status_code == 200 and sresp.status_code == 200, resp.text + sresp.text
        text = resp.json()["choices"][0]["text"]
        events = [e[len("data: "):] for e in sresp.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]) == text
        texts.append(text)
    check_output("json", texts[3])
    check_output("regex", texts[4])
    params = [SamplingParams(temperature=0.0, max_tokens=b["max_tokens"]) for b in bodies[:3]]
    params += [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
               SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(regex=REGEX))]
    expected = [o.outputs[0].text for o in oracle.generate([b["prompt"] for b in bodies], params)]
    assert texts == expected
    assert engine.metrics.summary()["spec_num_draft_tokens"] > 0, "the server's engine never speculated"
    assert_all_blocks_free(engine)
