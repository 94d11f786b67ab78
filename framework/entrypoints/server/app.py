"""The OpenAI-compatible FastAPI app over an :class:`~framework.engine.async_llm.AsyncLLM`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` -> Server-Sent
Events: ``data: {chunk}`` lines, then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /version``, ``GET /metrics`` (Prometheus text), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (with ``lora.allow_runtime_updates=true``). The ``model`` field picks the base
model or a LoRA adapter (``served_models.py``). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: malformed JSON / wrong-typed or unknown field
-> 400, unknown model -> 404 (vLLM's body: type ``NotFoundError``, code 404), missing/wrong bearer token on ``/v1/*`` (when an API key is set) ->
401, a plugin or the detokenizer failed on the request (``RequestOutput.internal_error``) -> 500,
engine shut down or dead -> 503. A streaming client that disconnects aborts its requests. Both completion
routes take vLLM's ``kv_transfer_params`` (``SamplingParams.kv_transfer_params``) and a non-streamed response carries
the KV connector's answer in its top-level ``kv_transfer_params`` (P/D serving: docs/kv_transfer.md).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from framework.core.faults import EngineDeadError
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import RequestOutputKind
from framework.entrypoints.server import responses as R
from framework.entrypoints.server.completions import CompletionChoices, engine_fields
from framework.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    error_body,
)
from framework.entrypoints.server.serving import (
    EngineJob,
    RequestError,
    ServerState,
    build_jobs,
    check_model,
    generate_final,
    merged_outputs,
    render_chat,
    tokenize_prompts,
)

#: one Server-Sent Event as OpenAPI tools parse it (schemathesis validates each event of a stream against it)
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}
_OK_STREAM = {"description": "the completion (JSON), or Server-Sent Events when stream is true",
              "content": {"application/json": {}, "text/event-stream": {"schema": _SSE_EVENT}}}


def _responses(*statuses: int, ok: dict[str, Any] | None = None) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of a route: its error statuses with OpenAI's error body and, when given, its 200
    (``ok``: description and content types), so ``/openapi.json`` says what the server really answers."""
    why = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model or route",
           500: "a plugin or the detokenizer failed on this request", 503: "the engine is shut down or dead"}
    out: dict[int | str, dict[str, Any]] = {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}
    if ok is not None:
        out[200] = ok
    return out


_V1_ERRORS = (400, 401, 404, 500, 503)


def _without_422(app: FastAPI) -> Any:
    """``app.openapi`` minus FastAPI's automatic 422 responses: validation errors are 400 here (OpenAI's)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


class _SSEResponse(StreamingResponse):
    """``text/event-stream`` response that always closes its body iterator (so a disconnect aborts
    the request at once, whichever way the ASGI server reports it)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.status, exc.param, exc.code, exc.kind), status_code=exc.status)


def _engine_error(exc: Exception) -> RequestError:
    """Map an engine-side failure to the error the client sees (rejection 400, engine down 503)."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, ValueError):
        return RequestError(str(exc), 400)
    if isinstance(exc, EngineDeadError):
        return RequestError(f"the engine is not available: {exc}", 503, code="engine_dead")
    if isinstance(exc, RuntimeError):  # the loop is shut down
        return RequestError(f"the engine is not available: {exc}", 503)
    return RequestError(f"internal error: {type(exc).__name__}: {exc}", 500, code="internal_error")


def _output_error(out: RequestOutput) -> RequestError:
    """The error of a request the engine finished with ``error`` set: a fault of the server (a plugin or the
    detokenizer raised on it) is 500, a rejection of the request (e.g. its grammar does not compile) 400."""
    if out.internal_error:
        return RequestError(f"internal error, this request was aborted: {out.error}", 500, code="internal_error")
    return RequestError(out.error, 400)


async def _until_disconnected(request: Request) -> None:
    """Return when the client has gone (the body is already read, so the next ASGI message is the disconnect)."""
    message = await request.receive()
    while message["type"] != "http.disconnect":
        message = await request.receive()


async def _final(state: ServerState, jobs: list[EngineJob], request: Request) -> list[Any]:
    """Final outputs of ``jobs``; a client that disconnects first aborts them (as vLLM's ``with_cancellation``)."""
    work = asyncio.ensure_future(generate_final(state.llm, jobs))
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()  # client gone (or handler cancelled): aborts every job
    if work not in done:
        raise RequestError("client disconnected; its requests were aborted", 499)
    try:
        outs = work.result()
    except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error body
        raise _engine_error(exc) from exc
    for out in outs:
        if out.error:
            raise _output_error(out)
    return outs


async def _stream(state: ServerState, jobs: list[EngineJob], rid: str, obj: str, num_prompt_tokens: int,
                  include_usage: bool, chunk_choices: Any, first_choices: list[dict] | None = None,
                  count: Any = None, model: str | None = None) -> AsyncIterator[str]:
    """SSE body shared by both endpoints; ``chunk_choices(job, output, seen) -> list[choice]`` (``seen``: a
    dict the callback keeps per-choice state in, e.g. text offset and last token id); ``count(output)``: the
    completion tokens it adds to ``usage`` (default: every generated token); ``model``: the chunks' ``model``
    (the name the request used; default the served name)."""
    created, num_out, seen = int(time.time()), 0, {}
    model = model or state.model_name
    try:
        for choice in first_choices or ():
            yield _sse(R.envelope(rid, obj, model, [choice], created=created))
        async with merged_outputs(state.llm, jobs) as outputs:
            async for job, out in outputs:
                if out.error:
                    raise _output_error(out)
                num_out += count(out) if count is not None else sum(len(c.token_ids) for c in out.outputs)
                for choice in chunk_choices(job, out, seen):  # one choice per chunk, as vLLM streams them
                    yield _sse(R.envelope(rid, obj, model, [choice], created=created))
        if include_usage:
            yield _sse(R.envelope(rid, obj, model, [], R.usage(num_prompt_tokens, num_out), created))
    except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes into the stream
        err = _engine_error(exc)
        yield _sse(error_body(err.message, err.status, err.param, err.code, err.kind))
    yield _sse("[DONE]")


def _with_kv_transfer(body: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
    """``body`` plus vLLM's top-level ``kv_transfer_params``: what the KV connector returned for the first prompt
    (a P/D prefill's handle that its decode request sends back), ``None`` when it returned nothing."""
    body["kv_transfer_params"] = outs[0].kv_transfer_params if outs else None
    return body


def _check_auth(request: Request) -> None:
    state: ServerState = request.app.state.servelab
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
        raise RequestError("Incorrect or missing API key: send 'Authorization: Bearer <server.api_key>'", 401,
                           code="invalid_api_key")


def _v1_routes(state: ServerState) -> APIRouter:
    """``/v1/*`` routes (bearer-token checked when ``state.api_key`` is set)."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(_check_auth)])

    @router.get("/models", responses=_responses(401, 500))
    async def models() -> dict[str, Any]:
        if state.models is not None:  # the base model and each LoRA adapter (``parent``: the base model)
            return {"object": "list", "data": state.models.cards()}
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "servelab", "max_model_len": state.max_model_len}]}

    _add_completions(router, state)
    _add_chat_completions(router, state)
    _add_lora_adapters(router, state)
    return router


def _add_lora_adapters(router: APIRouter, state: ServerState) -> None:
    """vLLM's ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter``
    (``{"lora_name"}``): plain-text success, else an error body (``framework/entrypoints/server/served_models.py``:
    404 while ``lora.allow_runtime_updates=false``, 400 for a folder that does not load; the server serves on)."""

    def served() -> Any:
        if state.models is None:
            raise RequestError("this server serves no LoRA adapters; start it with lora.enable=true and "
                               "lora.allow_runtime_updates=true", 404, kind="NotFoundError", code=404)
        return state.models

    @router.post("/load_lora_adapter", response_class=PlainTextResponse, responses=_responses(400, 401, 404))
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await served().load(req.lora_name, req.lora_path))

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse, responses=_responses(400, 401, 404))
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await served().unload(req.lora_name))


def _add_completions(router: APIRouter, state: ServerState) -> None:
    """``POST /v1/completions`` (echo, logprobs over prompt and output, ``max_tokens: 0``, ``best_of``:
    ``framework/entrypoints/server/completions.py``)."""

    @router.post("/completions", responses=_responses(*_V1_ERRORS, ok=_OK_STREAM))
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        lora = check_model(state, req.model)
        model = req.model or state.model_name
        max_tokens, logprobs, n, prompt_logprobs = engine_fields(req)
        prompts = tokenize_prompts(state, req.prompt)
        texts = req.prompt if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) else (
            [req.prompt] if isinstance(req.prompt, str) else [None] * len(prompts))
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        jobs = build_jobs(state, req, prompts, max_tokens, logprobs, kind, n=n, prompt_logprobs=prompt_logprobs,
                          lora_request=lora)
        rid, num_prompt = f"cmpl-{uuid.uuid4().hex}", sum(len(p) for p in prompts)
        choices = CompletionChoices(req, state.tokenizer, texts)
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(_stream(state, jobs, rid, "text_completion", num_prompt, include,
                                        lambda job, out, _: choices.chunk(job, out), count=choices.num_completion_tokens,
                                        model=model))
        outs = await _final(state, jobs, raw)
        body = [c for j, o in zip(jobs, outs) for c in choices.final(j, o)]
        return _with_kv_transfer(R.envelope(rid, "text_completion", model, sorted(body, key=lambda c: c["index"]),
                                            R.usage(num_prompt, sum(choices.num_completion_tokens(o) for o in outs))),
                                 outs)


def _add_chat_completions(router: APIRouter, state: ServerState) -> None:
    """``POST /v1/chat/completions``."""
    tok = state.tokenizer

    @router.post("/chat/completions", responses=_responses(*_V1_ERRORS, ok=_OK_STREAM))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        lora = check_model(state, req.model)
        model = req.model or state.model_name
        ids = render_chat(state, req.messages)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        jobs = build_jobs(state, req, [ids], max_tokens, num_top, kind, lora_request=lora)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def logprobs(out: Any, prev_id: int) -> dict | None:
            return None if num_top is None else R.chat_logprobs(tok, out, num_top, prev_id)

        if req.stream:
            def chunk(job: EngineJob, out: Any, seen: dict[int, int]) -> list[dict]:
                choices = []
                for c in out.outputs:
                    prev_id = seen.get(c.index, job.prompt_token_ids[-1])
                    seen[c.index] = c.token_ids[-1] if c.token_ids else prev_id
                    if not (c.text or c.finish_reason or (c.token_ids and num_top is not None)):
                        continue
                    delta = {"content": c.text} if c.text or not c.finish_reason else {}
                    choices.append(R.chat_delta_choice(c.index, delta, logprobs(c, prev_id), c.finish_reason))
                return choices

            first = [R.chat_delta_choice(i, {"role": "assistant", "content": ""}) for i in range(req.n)]
            include = bool(req.stream_options and req.stream_options.include_usage)
            return _SSEResponse(_stream(state, jobs, rid, "chat.completion.chunk", len(ids), include, chunk, first,
                                        model=model))
        outs = await _final(state, jobs, raw)
        choices = [R.chat_choice(c.index, c, logprobs(c, jobs[0].prompt_token_ids[-1])) for c in outs[0].outputs]
        return _with_kv_transfer(R.envelope(rid, "chat.completion", model, choices,
                                            R.usage(len(ids), sum(len(c.token_ids) for c in outs[0].outputs))), outs)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app serving ``state.llm`` under ``state.model_name``.

    The app does not own the engine loop: whoever built ``state.llm`` shuts it down (see
    :func:`framework.entrypoints.server.launch.serve`).
    """
    app = FastAPI(title="servelab", version=_version())
    app.openapi = _without_422(app)
    app.state.servelab = state

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ())[1:]]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            message = f"invalid field {'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return _error(RequestError(message, 400, ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(RequestError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:  # a bug: still an OpenAI body (and logged)
        return _error(_engine_error(exc))

    @app.get("/health", response_class=Response, responses=_responses(503))
    async def health() -> Response:
        if state.llm.errored is not None or not state.llm.is_running:
            return _error(RequestError(f"engine loop is down ({state.llm.errored or 'shut down'})", 503))
        if not state.llm.ready:  # vLLM's readiness: 503 until the engine serves (requests queue meanwhile)
            return _error(RequestError(f"compiling: the engine is compiling the model ({state.llm.startup_s:.0f} s "
                                       "so far); requests sent now wait until it is ready", 503))
        alive = state.llm.replica_alive()  # data-parallel replicas: serving, but some may be dead
        if len(alive) > 1 and not all(alive):
            return JSONResponse({"status": "degraded", "data_parallel_size": len(alive),
                                 "alive_replicas": [i for i, ok in enumerate(alive) if ok],
                                 "dead_replicas": [i for i, ok in enumerate(alive) if not ok]}, status_code=200)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        if state.metrics is None:
            return _error(RequestError("metrics are not enabled on this app", 404))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(_v1_routes(state))
    return app


def _version() -> str:
    try:
        return metadata.version("servelab")
    except metadata.PackageNotFoundError:
        return "unknown"

