"""OpenAI-shaped request bodies of the server (pydantic v2), and the error body.

Field names and defaults follow the OpenAI API and vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``priority``, ``min_tokens``, ``stop_token_ids``,
``structured_outputs``, ``kv_transfer_params``). Models are strict (``"5"`` is not an int) and forbid unknown
fields, so a wrong-typed or unsupported field is an HTTP 400 naming it instead of being silently ignored.
Responses are plain dicts built in :mod:`framework.entrypoints.server.app` (their shapes are documented there).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and no choices."""

    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat completions (OpenAI + vLLM extensions)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None  # served model name; None = the only served model
    n: int = Field(1, ge=1, le=128)  # completions per prompt (the engine's parallel sampling: shared prompt KV)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension; 0 or -1 = off
    min_p: float = 0.0  # vLLM extension
    seed: int | None = None  # with n > 1, completion i uses seed + i (vLLM's rule)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension
    ignore_eos: bool = False  # vLLM extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI) -> bias in [-100, 100]
    min_tokens: int = 0  # vLLM extension
    priority: int = 0  # vLLM extension; lower is served first (scheduler=priority)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict[str, Any] | None = None  # vLLM extension: {"json"|"regex"|"choice"|"grammar": ...}
    user: str | None = None  # accepted and ignored (OpenAI end-user id)
    # vLLM extension (P/D disaggregation): what the KV connector reads for this request, e.g. the toy proxy's
    # {"do_remote_decode": true} on a prefill, or a prefill response's kv_transfer_params on its decode
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body.

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists; each
    prompt gets ``n`` choices (choice index = prompt index * n + i). ``logprobs``: top-N per token
    (0..20). ``max_tokens`` defaults to 16 as in the OpenAI API; 0 only with ``echo`` (the prompt's
    logprobs alone, as lm-evaluation-harness asks). ``echo``: the choice's text and logprobs start with
    the prompt's (its first token's logprob is ``null``). ``best_of``: sample that many and return the
    ``n`` with the highest mean token logprob (not with ``stream``).
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(strict=True, extra="allow")  # e.g. "name"; passed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body.

    ``messages`` are rendered with the tokenizer's chat template (generation prompt added).
    ``max_completion_tokens`` (newer OpenAI name) wins over ``max_tokens``; both default to the
    rest of the context. ``logprobs: true`` returns the sampled token's logprob, plus
    ``top_logprobs`` (0..20) alternatives per position.
    """

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ErrorInfo(BaseModel):
    """The ``error`` object of OpenAI's error body (documents the schema in ``/openapi.json``)."""

    message: str  # what went wrong and how to fix it
    type: str  # invalid_request_error | authentication_error | service_unavailable_error | server_error | NotFoundError
    param: str | None  # the offending field, when one is
    code: str | int | None  # machine-readable reason (e.g. context_length_exceeded, engine_dead; vLLM's 404), or None


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` body (vLLM's): serve the PEFT folder ``lora_path`` as model ``lora_name``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` body (vLLM's): stop serving model ``lora_name``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str | None = None
    lora_int_id: int | None = None  # accepted as vLLM does, unused (the name identifies the adapter)


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def error_body(message: str, status: int, param: str | None = None, code: str | int | None = None,
               kind: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``.

    ``type`` is ``kind`` when given (vLLM's ``NotFoundError`` for an unknown model or adapter), else it follows the
    status (400/404 ``invalid_request_error``, 401 ``authentication_error``, 503 ``service_unavailable_error``,
    else ``server_error``).
    """
    kind = kind or {400: "invalid_request_error", 404: "invalid_request_error", 401: "authentication_error",
            503: "service_unavailable_error"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
