"""``/v1/completions`` as lm-evaluation-harness and vLLM users call it (in-process app, stories260K in float32):
``echo`` with ``logprobs`` over the prompt (equal to transformers' log-softmax) and the output, ``max_tokens: 0``,
token-id and batched prompts, ``n`` with seeds, ``best_of``, streaming with echo, chat ``n``."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402
from helpers import STORIES, STORY_PROMPTS, assert_all_blocks_free  # noqa: E402

from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def state():
    from framework import LLM

    engine = LLM(model=STORIES, dtype="float32", compile=False, num_blocks=256, max_num_batched_tokens=32).engine
    front = AsyncLLM(engine)
    yield ServerState(llm=front, model_name="tiny", max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                      tokenizer=engine.tokenizer, supports_structured_outputs=engine.structured_output is not None)
    front.shutdown()
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return logprobs


def post(state: ServerState, body: dict, path: str = "/v1/completions") -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def completions(state: ServerState, **body) -> dict:
    resp = post(state, {"model": "tiny", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_echo_max_tokens_zero_gives_the_prompt_logprobs(state, reference):
    """lm-eval's loglikelihood request: the prompt's ``token_logprobs`` equal transformers', ``null`` first."""
    ids = [state.tokenizer(p).input_ids for p in STORY_PROMPTS[3:6]]
    out = completions(state, prompt=ids, echo=True, logprobs=3, max_tokens=0, temperature=0.0)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == sum(map(len, ids))
    for choice, prompt in zip(sorted(out["choices"], key=lambda c: c["index"]), ids):
        lp = choice["logprobs"]
        assert choice["text"] == state.tokenizer.decode(prompt) and len(lp["tokens"]) == len(prompt)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = reference(prompt)
        for t in range(1, len(prompt)):
            assert abs(lp["token_logprobs"][t] - ref[t - 1, prompt[t]].item()) < TOL
            assert 3 <= len(lp["top_logprobs"][t]) <= 4
            assert max(lp["top_logprobs"][t].values()) == pytest.approx(ref[t - 1].max().item(), abs=TOL)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_then_generated_tokens(state):
    """A text prompt echoed as sent, then its completion; the logprobs of the generated part equal those of
    the same request without echo."""
    prompt = STORY_PROMPTS[0]
    plain = completions(state, prompt=prompt, max_tokens=5, logprobs=2, temperature=0.0, ignore_eos=True)["choices"][0]
    echoed = completions(state, prompt=prompt, max_tokens=5, logprobs=2, temperature=0.0, ignore_eos=True,
                         echo=True)["choices"][0]
    num_prompt = len(state.tokenizer(prompt).input_ids)
    assert echoed["text"] == prompt + plain["text"]
    assert echoed["logprobs"]["token_logprobs"][num_prompt:] == pytest.approx(plain["logprobs"]["token_logprobs"],
                                                                              abs=TOL)
    assert len(echoed["logprobs"]["tokens"]) == num_prompt + 5
    no_lp = completions(state, prompt=prompt, max_tokens=5, temperature=0.0, ignore_eos=True, echo=True)["choices"][0]
    assert no_lp["text"] == echoed["text"] and no_lp["logprobs"] is None


def test_n_with_seed_equals_each_seed_alone(state):
    body = {"prompt": [STORY_PROMPTS[1], STORY_PROMPTS[2]], "max_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    out = completions(state, n=3, seed=11, **body)
    assert sorted(c["index"] for c in out["choices"]) == list(range(6))
    assert out["usage"]["completion_tokens"] == 60
    by_index = {c["index"]: c["text"] for c in out["choices"]}
    for p in (0, 1):
        texts = [by_index[p * 3 + i] for i in range(3)]
        assert len(set(texts)) == 3
        for i, text in enumerate(texts):
            alone = completions(state, **{**body, "prompt": body["prompt"][p]}, seed=11 + i)["choices"][0]["text"]
            assert alone == text


def test_best_of_keeps_the_highest_mean_logprob(state):
    body = {"prompt": STORY_PROMPTS[4], "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "seed": 3}
    samples = completions(state, n=3, logprobs=0, **body)["choices"]
    best = completions(state, best_of=3, **body)["choices"]
    assert len(best) == 1 and best[0]["index"] == 0 and best[0]["logprobs"] is None
    means = {c["text"]: sum(c["logprobs"]["token_logprobs"]) / 8 for c in samples}
    assert best[0]["text"] == max(means, key=means.get)


def test_streamed_echo_with_logprobs_equals_the_whole_response(state):
    body = {"prompt": STORY_PROMPTS[5], "max_tokens": 6, "temperature": 1.0, "seed": 5, "ignore_eos": True,
            "echo": True, "logprobs": 1, "n": 2}
    whole = {c["index"]: c for c in completions(state, **body)["choices"]}
    resp = post(state, {**body, "stream": True})
    events = [line[len("data: "):] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"] for e in events[:-1]]
    for index in (0, 1):
        parts = [c for choices in chunks for c in choices if c["index"] == index]
        assert "".join(p["text"] for p in parts) == whole[index]["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            assert [v for p in parts for v in p["logprobs"][key]] == whole[index]["logprobs"][key]


def test_chat_n_and_top_logprobs(state):
    templated = ServerState(**{**state.__dict__, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 6,
            "temperature": 1.0, "seed": 1, "n": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    resp = post(templated, body, "/v1/chat/completions")
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and resp.json()["usage"]["completion_tokens"] == 12
    assert all(len(c["logprobs"]["content"]) == 6 for c in choices)
    assert all(len(t["top_logprobs"]) == 2 for c in choices for t in c["logprobs"]["content"])
