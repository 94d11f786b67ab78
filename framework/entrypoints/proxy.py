"""``servelab proxy --prefill URL --decode URL``: disaggregated prefill/decode over two OpenAI servers.

vLLM's toy P/D proxy (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, the NixlConnector docs), as a
real command. Each ``POST /v1/completions`` or ``POST /v1/chat/completions`` goes twice:

1. to a **prefill** server (``servelab serve kv_transfer.role=kv_producer ...``), non-streamed, with
   ``max_tokens = 1`` (and ``max_completion_tokens = 1`` when the body has it), no ``stream_options``, and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}`` (``PREFILL_KV_TRANSFER_PARAMS``, what
   ``servelab serve disagg.prefill_replicas=P`` asks of its prefill replicas too): the prefill computes (and its KV
   connector stores or holds) the prompt's KV;
2. to a **decode** server (``... kv_transfer.role=kv_consumer``) with the client's body unchanged except for
   ``kv_transfer_params``, set to the prefill response's top-level ``kv_transfer_params`` when it has one (the
   connector's handle to the prefilled KV); the decode response (streamed or not) goes back to the client as it
   comes, status and all.

A prefill that fails (any status but 200) is the client's answer: the decode is not sent. With several ``--prefill``
or ``--decode`` URLs each request takes the next of each in turn (round robin, as the toy proxy). A client that
disconnects while its decode streams closes the decode connection, which aborts the request on the decode server.
``GET /health`` is 200 when every server answers its own ``/health`` with 200, else 503 naming the first that does
not; ``GET /v1/models`` is the first decode server's.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# the prefill request's kv_transfer_params: the one-command P/D front asks the same of its prefill replicas
from framework.engine.async_llm import PREFILL_KV_TRANSFER_PARAMS

logger = logging.getLogger("servelab.proxy")

#: request headers forwarded to both servers (the bearer token and the client's request id)
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's copy of a client body: one output token, not streamed, asking the KV connector to
    keep the prompt's KV for a remote decode (:data:`PREFILL_KV_TRANSFER_PARAMS`)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode server's copy of a client body: as sent, plus the prefill response's ``kv_transfer_params``
    when it carries any (else the body's own, if the client sent some)."""
    params = prefill_response.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


class _Backends:
    """The prefill and decode base URLs, each list taken in turn (round robin)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        if not prefill or not decode:
            raise ValueError("servelab proxy needs at least one --prefill URL and one --decode URL")
        self.prefill, self.decode = [u.rstrip("/") for u in prefill], [u.rstrip("/") for u in decode]
        self._next_prefill, self._next_decode = itertools.cycle(self.prefill), itertools.cycle(self.decode)

    def pick(self) -> tuple[str, str]:
        """``(prefill URL, decode URL)`` for the next request."""
        return next(self._next_prefill), next(self._next_decode)


def build_proxy_app(prefill_urls: Sequence[str], decode_urls: Sequence[str],
                    client: httpx.AsyncClient | None = None) -> FastAPI:
    """The proxy's FastAPI app (see the module docstring).

    Args:
        prefill_urls, decode_urls: servers' base URLs (``http://host:port``, without ``/v1``).
        client: an ``httpx.AsyncClient`` to reach them (tests pass one over ASGI transports); default: one the app
            opens at start-up and closes at shut-down, with no timeout (a decode may stream for minutes).

    Raises:
        ValueError: no prefill or no decode URL.
    """
    backends = _Backends(prefill_urls, decode_urls)
    holder: dict[str, Any] = {"client": client}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        own = holder["client"] is None
        if own:
            holder["client"] = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000))
        try:
            yield
        finally:
            if own:
                await holder["client"].aclose()

    app = FastAPI(title="servelab proxy", lifespan=lifespan)

    def http() -> Any:
        if holder["client"] is None:  # an app driven without its lifespan (httpx's ASGI transport)
            holder["client"] = httpx.AsyncClient(timeout=None)
        return holder["client"]

    async def forward(raw: Request, path: str) -> Response:
        try:
            body = await raw.json()
        except ValueError as exc:
            return JSONResponse(_error(f"malformed JSON body: {exc}", 400), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error("the request body must be a JSON object", 400), status_code=400)
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        prefill_url, decode_url = backends.pick()
        try:
            first = await http().post(f"{prefill_url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            return JSONResponse(_error(f"prefill server {prefill_url} unreachable: {exc}", 502), status_code=502)
        if first.status_code != 200:
            return Response(first.content, status_code=first.status_code, media_type="application/json")
        request = http().build_request("POST", f"{decode_url}{path}", json=decode_body(body, first.json()),
                                       headers=headers)
        try:
            second = await http().send(request, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse(_error(f"decode server {decode_url} unreachable: {exc}", 502), status_code=502)
        if not body.get("stream") or second.status_code != 200:
            content = await second.aread()
            await second.aclose()
            return Response(content, status_code=second.status_code,
                            media_type=second.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in second.aiter_raw():
                    yield chunk
            finally:  # the client went away or the stream ended: close the decode connection (aborts it there)
                await second.aclose()

        return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await forward(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED_HEADERS}
        resp = await http().get(f"{backends.decode[0]}/v1/models", headers=headers)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        for url in [*backends.prefill, *backends.decode]:
            try:
                status = (await http().get(f"{url}/health")).status_code
            except httpx.HTTPError as exc:
                status = f"unreachable ({exc})"
            if status != 200:
                return JSONResponse(_error(f"server {url} is not healthy: {status}", 503), status_code=503)
        return Response(status_code=200)

    return app


def _error(message: str, status: int) -> dict[str, Any]:
    """OpenAI's error body (the servers' own shape: ``framework.entrypoints.server.protocol.error_body``)."""
    kind = {400: "invalid_request_error", 503: "service_unavailable_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def main(argv: list[str]) -> int:
    """``servelab proxy --prefill URL [--prefill URL ...] --decode URL [...] [--host H] [--port P]``: serve the
    proxy with uvicorn until SIGINT/SIGTERM; exit status 2 on a usage error."""
    parser = argparse.ArgumentParser(prog="servelab proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill server's base URL (kv_transfer.role=kv_producer); repeat for several")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode server's base URL (kv_transfer.role=kv_consumer); repeat for several")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    import uvicorn

    app = build_proxy_app(args.prefill, args.decode)
    logger.info("P/D proxy at http://%s:%d/v1: prefill %s, decode %s", args.host, args.port, args.prefill,
                args.decode)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "build_proxy_app", "decode_body", "main", "prefill_body"]
