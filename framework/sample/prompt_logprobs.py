"""Prompt logprobs: the log-probability of every prompt token given the tokens before it, computed in
the same forward as the prefill (vLLM's ``SamplingParams.prompt_logprobs``).

The logits at position ``p`` predict token ``p + 1``, so a prefill chunk covering positions
``[start, end)`` of a ``P``-token prompt yields the logprobs of prompt tokens ``start + 1 ..
min(end, P - 1)``: every chunk of a chunked prefill brings its own, and the last prompt position (which
predicts the first output token) is the ordinary sampling row. Token 0 has no logprob (``None``, as
vLLM). Values are raw: ``log_softmax`` of the model's logits in float32, before temperature,
penalties, bias or grammar masks (vLLM V1's ``raw_logprobs`` mode), so they equal transformers'
``log_softmax(model(prompt).logits)``.

A request that asks for prompt logprobs never reads the prefix cache (``Scheduler._lookup``): a hit
would skip the forward of its cached tokens and with it their logits (vLLM V1 skips the cache the
same way). It still publishes its blocks for others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Rows turned into float32 log-probabilities at a time (256 x 49152 float32 = 48 MiB).
ROWS_PER_CHUNK = 256


@dataclass
class PromptLogprobRows:
    """Where a step's prompt-logprob rows are: request ``request_ids[i]`` owns ``counts[i]`` consecutive
    rows of the step's extra logits, which give the logprobs of its prompt tokens ``first_token[i] ..
    first_token[i] + counts[i] - 1``; ``next_token_ids`` are those tokens, row by row."""

    request_ids: list[str]
    first_token: list[int]  # index (in the prompt) of the token each request's first row predicts
    counts: list[int]  # rows per request (>= 1)
    num_top: list[int]  # per request: top-k logprobs wanted besides the prompt token's own (>= 0)
    next_token_ids: np.ndarray  # (sum(counts),) int64, the prompt token each row predicts
    token_index: np.ndarray  # (sum(counts),) int64, flattened index (in the step) of each row's position


def prompt_logprob_rows(requests: list[Any], query_start_loc: np.ndarray, context_lens: np.ndarray,
                        query_lens: np.ndarray) -> PromptLogprobRows | None:
    """The step's prompt-logprob rows, or ``None`` when no scheduled request needs any.

    Args:
        requests: batch order; request-like (``prompt_token_ids``, ``sampling_params``, ``request_id``).
        query_start_loc: (num_reqs + 1,) int64, first flattened token of each request.
        context_lens: (num_reqs,) int64, position of each request's first scheduled token.
        query_lens: (num_reqs,) int64, tokens scheduled per request.

    Returns:
        The rows of positions ``p`` in ``[context, min(context + query, P - 1))`` of every request with
        ``prompt_logprobs`` set (``P``: its prompt length).
    """
    ids, first, counts, num_top, next_ids, index = [], [], [], [], [], []
    for i, request in enumerate(requests):
        k = request.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = int(context_lens[i])
        end = min(start + int(query_lens[i]), len(request.prompt_token_ids) - 1)
        if end <= start:
            continue
        ids.append(request.request_id)
        first.append(start + 1)
        counts.append(end - start)
        num_top.append(k)
        next_ids.append(np.asarray(request.prompt_token_ids[start + 1:end + 1], dtype=np.int64))
        index.append(np.arange(end - start, dtype=np.int64) + int(query_start_loc[i]))
    if not ids:
        return None
    return PromptLogprobRows(ids, first, counts, num_top, np.concatenate(next_ids), np.concatenate(index))


def gather_prompt_logprobs(logits: torch.Tensor, rows: PromptLogprobRows,
                           vocab_size: int) -> dict[str, tuple[int, list[dict[int, float]]]]:
    """Per request, its prompt tokens' logprobs from the rows' logits.

    Each position's dict holds the prompt token's logprob and the ``num_top`` most likely tokens' (so
    ``num_top`` or ``num_top + 1`` entries), as vLLM's prompt logprobs.

    Args:
        logits: (sum(rows.counts), >= vocab_size) any float dtype; columns past ``vocab_size`` (a padded
            vocabulary) are dropped. Not modified.
        rows: where each request's rows are.
        vocab_size: real vocabulary size.

    Returns:
        request_id -> ``(first_token, [ {token id: logprob} per row ])``.
    """
    max_k = min(max(rows.num_top), vocab_size)
    next_ids = torch.from_numpy(rows.next_token_ids).to(logits.device)
    token_lp, top_vals, top_ids = [], [], []
    for lo in range(0, logits.shape[0], ROWS_PER_CHUNK):
        chunk = logits[lo:lo + ROWS_PER_CHUNK, :vocab_size].float().log_softmax(dim=1)
        token_lp.append(chunk.gather(1, next_ids[lo:lo + ROWS_PER_CHUNK, None])[:, 0])
        if max_k:
            vals, idx = chunk.topk(max_k, dim=1)
            top_vals.append(vals)
            top_ids.append(idx)
    token_lps = torch.cat(token_lp).tolist()
    tops = (torch.cat(top_ids).tolist(), torch.cat(top_vals).tolist()) if max_k else None
    next_list = rows.next_token_ids.tolist()
    out: dict[str, tuple[int, list[dict[int, float]]]] = {}
    row = 0
    for rid, first, count, k in zip(rows.request_ids, rows.first_token, rows.counts, rows.num_top):
        entries = []
        for r in range(row, row + count):
            entry = dict(zip(tops[0][r][:k], tops[1][r][:k])) if tops is not None and k else {}
            entry[next_list[r]] = token_lps[r]
            entries.append(entry)
        out[rid] = (first, entries)
        row += count
    return out
