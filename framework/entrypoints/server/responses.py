"""OpenAI response bodies (plain dicts) built from engine outputs.

Shapes (OpenAI API): completions ``{"id": "cmpl-...", "object": "text_completion", "created",
"model", "choices": [{"index", "text", "logprobs", "finish_reason", "stop_reason"}], "usage"}``;
chat ``{"id": "chatcmpl-...", "object": "chat.completion", ..., "choices": [{"index", "message":
{"role": "assistant", "content"}, "logprobs", "finish_reason"}]}``; streamed chunks use
``"object": "chat.completion.chunk"`` with ``delta`` instead of ``message`` (completions chunks
keep ``text_completion``). ``finish_reason`` is ``stop``, ``length`` or ``abort`` (vLLM's value
for an aborted request, e.g. at server shutdown).
"""

from __future__ import annotations

import time
from typing import Any

from framework.core.outputs import CompletionOutput


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """``usage`` object: token counts of one API request (prompts counted once, all choices' outputs)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(response_id: str, obj: str, model: str, choices: list[dict[str, Any]],
             usage_: dict[str, int] | None = None, created: int | None = None) -> dict[str, Any]:
    """Top-level response/chunk object; ``created`` is Unix seconds (default now)."""
    return {"id": response_id, "object": obj, "created": int(time.time()) if created is None else created,
            "model": model, "choices": choices, "usage": usage_}


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely (token id, logprob) pairs of one position, best first."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:n]


def token_texts(tokenizer: Any, token_ids: list[int], prev_id: int | None) -> list[str]:
    """Text of each token as it reads in context (SentencePiece drops a leading space when a token is
    decoded alone): ``decode([prev, t]) - decode([prev])`` with ``prev`` the preceding token id."""
    texts = []
    for tid in token_ids:
        if prev_id is None:
            texts.append(tokenizer.decode([tid]))
        else:
            texts.append(tokenizer.decode([prev_id, tid])[len(tokenizer.decode([prev_id])):])
        prev_id = tid
    return texts


def completion_logprobs(tokenizer: Any, out: CompletionOutput, num_top: int, text_offset: int,
                        prev_id: int | None) -> dict[str, Any]:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob,
    ``num_top`` per position) and ``text_offset`` (character offsets, starting at ``text_offset``).
    ``prev_id``: the token before ``out.token_ids`` (last prompt token or last streamed token)."""
    tokens = token_texts(tokenizer, out.token_ids, prev_id)
    token_lps, tops, offsets = [], [], []
    prevs = [prev_id, *out.token_ids[:-1]]
    for tid, prev, token, lps in zip(out.token_ids, prevs, tokens, out.logprobs or []):
        token_lps.append(lps.get(tid))
        tops.append({token_texts(tokenizer, [k], prev)[0]: v for k, v in _top(lps, num_top)})
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, out: CompletionOutput, num_top: int, prev_id: int | None) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    def entry(tid: int, prev: int | None, lp: float | None) -> dict[str, Any]:
        token = token_texts(tokenizer, [tid], prev)[0]
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}

    content = []
    prevs = [prev_id, *out.token_ids[:-1]]
    for tid, prev, lps in zip(out.token_ids, prevs, out.logprobs or []):
        content.append({**entry(tid, prev, lps.get(tid)),
                        "top_logprobs": [entry(k, prev, v) for k, v in _top(lps, num_top)]})
    return {"content": content}


def completion_choice(index: int, out: CompletionOutput, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One completions choice (also one streamed completions chunk's choice, with ``text`` the delta)."""
    stop_reason = out.stop_reason if out.finish_reason else None
    return {"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, out: CompletionOutput, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One non-streamed chat choice."""
    stop_reason = out.stop_reason if out.finish_reason else None
    return {"index": index, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs,
            "finish_reason": out.finish_reason, "stop_reason": stop_reason}


def chat_delta_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
                      finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chat chunk's choice: ``delta`` is ``{"role": "assistant", "content": ""}`` first,
    then ``{"content": text}``."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
