"""From an OpenAI request body to engine requests, and their outputs merged back (no HTTP here).

Everything that can be rejected is checked here, before a request reaches the engine (prompt
tokenization, context length, sampling ranges, structured-output spec), so a bad request is an
HTTP 400 with a message naming the fix and never touches engine state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from framework.core.lora_request import LoRARequest
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.core.structured_output_params import structured_outputs_from_openai
from framework.engine.async_llm import AsyncLLM
from framework.entrypoints.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI error body with HTTP ``status`` (``kind``: the body's
    ``type`` when it is not the status's default, e.g. vLLM's ``NotFoundError``; ``code``: a string, or vLLM's
    integer status)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | int | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind


@dataclasses.dataclass
class ServerState:
    """What the routes share: the engine front end and read-only facts about the model.

    ``max_model_len``/``vocab_size``/``tokenizer`` are read from the engine once at start-up; the
    tokenizer is only used to encode prompts and render chat templates (the engine thread decodes).
    """

    llm: AsyncLLM
    model_name: str  # served model name (the ``model`` field must equal it)
    max_model_len: int  # prompt + output cap, tokens
    vocab_size: int  # token ids must be in [0, vocab_size)
    tokenizer: Any  # HF tokenizer, or None (then only token-id prompts work)
    supports_structured_outputs: bool  # engine built with grammar != none
    chat_template: str | None = None  # Jinja template overriding the tokenizer's (server.chat_template)
    api_key: str | None = None  # required bearer token; None = no auth
    metrics: Any = None  # ServerMetrics, or None
    models: Any = None  # ServedModels (served_models.py): base + LoRA adapter names; None = the base model alone


@dataclasses.dataclass
class EngineJob:
    """One engine request of an API request: one prompt and its ``params.n`` sequences (the engine's parallel
    sampling); its choices are ``index * n + i`` for sequence ``i`` of the API request's ``n``."""

    index: int  # the prompt's position in the API request
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    lora_request: LoRARequest | None = None  # the adapter the ``model`` field named; None: the base model


def model_not_found(model: str) -> RequestError:
    """vLLM's 404 for a ``model`` field naming neither the served model nor a loaded adapter: ``{"error":
    {"message": "The model `X` does not exist.", "type": "NotFoundError", "param": null, "code": 404}}``."""
    return RequestError(f"The model `{model}` does not exist.", 404, kind="NotFoundError", code=404)


def check_model(state: ServerState, model: str | None) -> LoRARequest | None:
    """The LoRA adapter the ``model`` field names (``state.models``), ``None`` for the base model (its served
    name, or no ``model`` field).

    Raises:
        RequestError(404): vLLM's body, "The model `X` does not exist.", type ``NotFoundError``, code 404.
    """
    if state.models is not None:
        return state.models.lora_request(model)
    if model is not None and model != state.model_name:
        raise model_not_found(model)
    return None


def tokenize_prompts(state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
    """Token ids of each prompt of a completions request (text gets the tokenizer's special tokens).

    Raises:
        RequestError(400): empty prompt list/prompt, token ids outside the vocabulary, text
            without a tokenizer.
    """
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise RequestError("prompt must not be an empty list", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if state.tokenizer is None:
                raise RequestError("this model has no tokenizer; send prompt token ids", param="prompt")
            p = list(state.tokenizer(p).input_ids)
        out.append(check_prompt_ids(state, p, "prompt"))
    return out


def check_prompt_ids(state: ServerState, ids: list[int], param: str) -> list[int]:
    """``ids`` unchanged if non-empty and inside the vocabulary; else RequestError(400)."""
    if not ids:
        raise RequestError("the prompt is empty: give at least one token", param=param)
    if min(ids) < 0 or max(ids) >= state.vocab_size:
        raise RequestError(f"prompt token ids must be in [0, {state.vocab_size})", param=param)
    return ids


def _content_text(message: ChatMessage) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"only text content parts are supported, got {part.get('type')!r}",
                                   param="messages")
            parts.append(part["text"])
        data["content"] = "".join(parts)
    return data


def render_chat(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    """Prompt ids of ``messages`` through the chat template (generation prompt added, no extra BOS).

    Raises:
        RequestError(400): no chat template (tokenizer has none and no ``server.chat_template``),
            non-text content parts, or the template refuses the conversation.
    """
    tok = state.tokenizer
    if tok is None or not (state.chat_template or getattr(tok, "chat_template", None)):
        raise RequestError(f"model `{state.model_name}` has no chat template, so /v1/chat/completions cannot "
                           "render messages; start the server with server.chat_template=<Jinja string or file> "
                           "or use /v1/completions", param="messages", code="no_chat_template")
    conversation = [_content_text(m) for m in messages]
    try:
        text = tok.apply_chat_template(conversation, chat_template=state.chat_template, add_generation_prompt=True,
                                       tokenize=False)
    except Exception as exc:  # noqa: BLE001 - Jinja errors (e.g. raise_exception on a bad role) -> 400
        raise RequestError(f"the chat template could not render the messages: {exc}", param="messages") from exc
    return check_prompt_ids(state, list(tok(text, add_special_tokens=False).input_ids), "messages")


def _max_tokens(state: ServerState, num_prompt: int, requested: int | None) -> int:
    """Output cap of one prompt, tokens; RequestError(400) naming the context limit when it does not fit."""
    room = state.max_model_len - num_prompt
    if requested is None:
        if room < 1:
            raise RequestError(f"This model's maximum context length is {state.max_model_len} tokens, but the prompt "
                               f"has {num_prompt} tokens; shorten the prompt", param="messages")
        return room
    if requested > room:
        raise RequestError(f"This model's maximum context length is {state.max_model_len} tokens. However, you "
                           f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} for "
                           "the completion). Reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
    return requested


def build_jobs(state: ServerState, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
               max_tokens: int | None, logprobs: int | None, kind: RequestOutputKind, n: int | None = None,
               prompt_logprobs: int | None = None, lora_request: LoRARequest | None = None) -> list[EngineJob]:
    """One :class:`EngineJob` per prompt, each running ``n`` sequences (default ``req.n``) in the engine
    (seeds ``seed + i``, the prompt's KV shared through the prefix cache).

    Args:
        n: sequences per prompt (``best_of`` when the server picks the best ``req.n`` of more).
        prompt_logprobs: top logprobs per prompt token (``echo`` with ``logprobs``), or None.
        lora_request: the LoRA adapter every job runs under (:func:`check_model`), or None.

    Raises:
        RequestError(400): out-of-range sampling fields (message names the field and range), a bad
            ``response_format``/``structured_outputs``, or structured output on an engine with
            ``grammar=none``.
    """
    try:
        structured = structured_outputs_from_openai(req.response_format, req.structured_outputs)
    except ValueError as exc:
        raise RequestError(str(exc), param="response_format") from exc
    if structured is not None and not state.supports_structured_outputs:
        raise RequestError("structured output needs a grammar engine but the server runs with grammar=none; "
                           "restart it with grammar=xgrammar or grammar=llguidance", param="response_format")
    logit_bias = _logit_bias(req.logit_bias, state.vocab_size)
    base = uuid.uuid4().hex
    jobs = []
    for p, ids in enumerate(prompts):
        cap = _max_tokens(state, len(ids), max_tokens)
        try:
            params = SamplingParams(
                n=req.n if n is None else n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                min_p=req.min_p, seed=req.seed, stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                max_tokens=cap, logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=logit_bias,
                output_kind=kind, structured_outputs=structured, kv_transfer_params=req.kv_transfer_params)
            if params.seed is not None:  # the engine seeds sequence i with seed + i: check the last one too
                dataclasses.replace(params, seed=params.seed + params.n - 1)
        except ValueError as exc:
            raise RequestError(str(exc).removeprefix("Invalid SamplingParams: ")) from exc
        jobs.append(EngineJob(p, f"{base}-{p}", ids, params, req.priority, lora_request))
    return jobs


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as strings) with int keys; RequestError(400) for a key that is not a
    token id in ``[0, vocab_size)`` (a bias outside [-100, 100] is refused by ``SamplingParams``)."""
    if not bias:
        return None
    try:
        out = {int(k): v for k, v in bias.items()}
    except ValueError:
        out = {-1: 0.0}
    if min(out) < 0 or max(out) >= vocab_size:
        raise RequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {list(bias)[:5]!r}",
                           param="logit_bias")
    return out


async def generate_final(llm: AsyncLLM, jobs: list[EngineJob]) -> list[RequestOutput]:
    """Run ``jobs`` concurrently and return each one's final output (jobs in ``FINAL_ONLY`` kind).

    Raises:
        ValueError: the engine rejected a job (the others are aborted).
        RuntimeError: the engine loop is shut down or died.
    """
    async def one(job: EngineJob) -> RequestOutput:
        last = None
        async for out in llm.generate(job.prompt_token_ids, job.params, request_id=job.request_id,
                                      priority=job.priority, lora_request=job.lora_request):
            last = out
        return last

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # no-op for finished ones; aborts the rest


async def generate_merged(llm: AsyncLLM, jobs: list[EngineJob]) -> AsyncIterator[tuple[EngineJob, RequestOutput]]:
    """Interleave the incremental outputs of ``jobs`` as they arrive; ends when every job finished.

    Closing the iterator early (client disconnect) aborts every unfinished job.

    Raises:
        ValueError, RuntimeError: as :func:`generate_final`.
    """
    if len(jobs) == 1:  # the common case: no pump task, no second queue per token
        job = jobs[0]
        async with contextlib.aclosing(llm.generate(job.prompt_token_ids, job.params, request_id=job.request_id,
                                                    priority=job.priority, lora_request=job.lora_request)) as outputs:
            async for out in outputs:
                yield job, out
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(job: EngineJob) -> None:
        try:
            async for out in llm.generate(job.prompt_token_ids, job.params, request_id=job.request_id,
                                          priority=job.priority, lora_request=job.lora_request):
                merged.put_nowait((job, out))
        except Exception as exc:  # noqa: BLE001 - re-raised to the consumer below
            merged.put_nowait((job, exc))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    remaining = len(jobs)
    try:
        while remaining:
            job, item = await merged.get()
            if isinstance(item, Exception):
                raise item
            remaining -= item.finished
            yield job, item
    finally:
        for task in tasks:
            task.cancel()


@contextlib.asynccontextmanager
async def merged_outputs(llm: AsyncLLM, jobs: list[EngineJob]) -> AsyncIterator[AsyncIterator]:
    """:func:`generate_merged` closed deterministically on exit (aborts unfinished jobs at once)."""
    stream = generate_merged(llm, jobs)
    try:
        yield stream
    finally:
        await stream.aclose()
