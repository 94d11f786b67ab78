"""The OpenAI endpoints fuzzed against their own OpenAPI schema with schemathesis (issue 34): a bounded number of
generated bodies per operation, in-process against the ASGI app over one stories260K engine. No 5xx, every response
conforms to the schema (every 4xx an OpenAI error body, every 200 a declared content type), bodies the schema
forbids are refused, and afterwards the engine serves a normal request and holds no KV block."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from helpers import STORIES, assert_all_blocks_free  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import checks  # noqa: E402

from framework.engine.async_llm import AsyncLLM  # noqa: E402
from framework.entrypoints.server.app import build_app  # noqa: E402
from framework.entrypoints.server.metrics import ServerMetrics  # noqa: E402
from framework.entrypoints.server.serving import ServerState  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.negative_data_rejection]


@pytest.fixture(scope="module")
def served():
    """``(app, engine)``: a short-context engine (max_model_len 64 bounds every generated request's work)."""
    from framework import LLM

    engine = LLM(model=STORIES, max_model_len=64, num_blocks=64).engine
    metrics = ServerMetrics("tiny")
    llm = AsyncLLM(engine, metrics=metrics)
    state = ServerState(llm=llm, model_name="tiny", max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                        tokenizer=engine.tokenizer, supports_structured_outputs=True, chat_template=TEMPLATE,
                        metrics=metrics)
    yield build_app(state), engine
    llm.shutdown()
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_asgi("/openapi.json", served[0])


# schemathesis' pytest integration (``from_fixture``) does not run under pytest 9, so each operation's strategy is
# driven by hypothesis directly; bodies that fit the schema and bodies that break it (negative mode)
OPERATIONS = [("POST", "/v1/completions", 60), ("POST", "/v1/chat/completions", 60), ("GET", "/v1/models", 5),
              ("GET", "/health", 3), ("GET", "/metrics", 3), ("GET", "/version", 3)]


@pytest.mark.parametrize("method, path, num_examples", OPERATIONS, ids=[f"{m} {p}" for m, p, _ in OPERATIONS])
def test_openai_endpoints_against_their_schema(api_schema, method, path, num_examples):
    from hypothesis import given
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=num_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        response = case.call()
        case.validate_response(response, checks=CHECKS)
        if 400 <= response.status_code < 500:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()


def test_engine_alive_after_fuzzing(served):
    """Runs after the fuzzing (file order): the engine still answers and every KV block came back."""
    from starlette.testclient import TestClient

    app, engine = served
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        resp = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    assert engine.kv_allocator.num_free_blocks == engine.kv_allocator.num_blocks



def test_fuzzed_sampling_and_structured_bodies(served):
    """Hypothesis bodies with the fields the schema cannot constrain (sampling ranges, stop strings, logit biases,
    structured-output specs: valid, invalid, unsatisfiable, huge): every answer is a 200 or an OpenAI-shaped 4xx."""
    from fuzz_strategies import SAMPLING, STRUCTURED, as_json_text
    from hypothesis import given
    from hypothesis import strategies as st
    from starlette.testclient import TestClient

    app, engine = served

    def body(sampling, spec, as_response_format, stream, echo):
        out = {k: v for k, v in sampling.items()
               if k not in ("skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs")}
        out.update(echo)
        if "logit_bias" in out:
            out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
        if spec is not None and as_response_format and "json" in spec:
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": spec["json"]}}
        elif spec is not None:
            out["structured_outputs"] = spec
        return {**out, "prompt": "Once upon a time", "stream": stream}

    echo = st.fixed_dictionaries({}, optional={"echo": st.booleans(), "best_of": st.integers(0, 4)})
    bodies = st.builds(body, SAMPLING, st.one_of(st.none(), STRUCTURED), st.booleans(), st.booleans(), echo)

    with TestClient(app) as client:
        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=bodies)
        def check(data):
            resp = client.post("/v1/completions", content=as_json_text(data),
                               headers={"content-type": "application/json"})
            assert resp.status_code in (200, 400), resp.text
            if resp.status_code == 400:
                assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
            elif data["stream"]:
                assert resp.text.rstrip().endswith("data: [DONE]") and '"server_error"' not in resp.text, resp.text

        check()
    assert engine.kv_allocator.num_free_blocks == engine.kv_allocator.num_blocks
