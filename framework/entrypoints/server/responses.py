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

#: the lowest logprob reported: ``-inf`` (a token masked out) is not valid JSON; OpenAI and vLLM send -9999.0
MIN_LOGPROB = -9999.0


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


def completion_logprobs(tokenizer: Any, token_ids: list[int], entries: list[dict[int, float] | None], num_top: int,
                        text_offset: int, prev_id: int | None) -> dict[str, Any]:
    """Legacy completions ``logprobs`` over ``token_ids`` (prompt tokens when echoing, then generated ones):
    ``tokens``, ``token_logprobs``, ``top_logprobs`` (token -> logprob: the ``num_top`` most likely and the
    token itself, so up to ``num_top + 1``, as OpenAI and vLLM) and ``text_offset`` (character offsets,
    starting at ``text_offset``). A ``None`` entry (a prompt's first token) gives ``None`` logprobs, as vLLM.
    Logprobs below :data:`MIN_LOGPROB` (``-inf``, which JSON cannot carry) are reported as it.

    Args:
        entries: per token, ids -> logprob holding the token's own (or ``None``); as long as ``token_ids``.
        prev_id: the token before ``token_ids`` (last prompt or streamed token), ``None`` at the prompt's start.
    """
    tokens = token_texts(tokenizer, token_ids, prev_id)
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets = []
    prevs = [prev_id, *token_ids[:-1]]
    for tid, prev, token, lps in zip(token_ids, prevs, tokens, entries):
        offsets.append(text_offset)
        text_offset += len(token)
        if lps is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_clamp(lps.get(tid)))
        top = _top(lps, num_top)
        if tid in lps and all(k != tid for k, _ in top):
            top.append((tid, lps[tid]))
        tops.append({token_texts(tokenizer, [k], prev)[0]: _clamp(v) for k, v in top})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, MIN_LOGPROB)


def chat_logprobs(tokenizer: Any, out: CompletionOutput, num_top: int, prev_id: int | None) -> dict[str, Any]:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    def entry(tid: int, prev: int | None, lp: float | None) -> dict[str, Any]:
        token = token_texts(tokenizer, [tid], prev)[0]
        return {"token": token, "logprob": _clamp(lp), "bytes": list(token.encode("utf-8"))}

    content = []
    prevs = [prev_id, *out.token_ids[:-1]]
    for tid, prev, lps in zip(out.token_ids, prevs, out.logprobs or []):
        content.append({**entry(tid, prev, lps.get(tid)),
                        "top_logprobs": [entry(k, prev, v) for k, v in _top(lps, num_top)]})
    return {"content": content}


def completion_choice(index: int, out: CompletionOutput, logprobs: dict[str, Any] | None,
                      text: str | None = None) -> dict[str, Any]:
    """One completions choice (also one streamed completions chunk's choice, with ``text`` the delta);
    ``text`` overrides ``out.text`` (the prompt and the completion when echoing)."""
    stop_reason = out.stop_reason if out.finish_reason else None
    return {"index": index, "text": out.text if text is None else text, "logprobs": logprobs,
            "finish_reason": out.finish_reason, "stop_reason": stop_reason}


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
