"""Per-request fault isolation in a worker's sampling calls (issue 44; the driver's ``RequestFaults``): a sampler
or rejection sampler that raises on a batch is rerun request by request, so only the culprit fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def guard_requests(fn: Callable[[torch.Tensor, list[Any], list[int]], list[Any]], logits: torch.Tensor,
                   requests: list[Any], rows_each: list[int], what: str, generators: list[torch.Generator],
                   errors: dict[str, tuple[str, str]]) -> list[Any]:
    """Per-request fault isolation on the worker side (issue 44; the driver's ``RequestFaults``): run
    ``fn(logits, requests, rows_each)`` (one result per request) over the batch; if it raises, restore
    ``generators`` (so no request's draws depend on the failure) and rerun it request by request: a request
    that still raises gets ``None`` and ``errors[request_id] = (what, "Type: message")`` (the engine aborts
    it with that error), every other request gets its result. A batch that fails while every request
    alone succeeds (no culprit) keeps the per-request results.

    Args:
        logits: ``(sum(rows_each), vocab)`` float; request ``i`` owns ``rows_each[i]`` consecutive rows.
        what: the failing part, for the error (``"sampler"``).
    """
    states = [g.get_state() for g in generators]
    try:
        return fn(logits, requests, rows_each)
    except Exception:  # noqa: BLE001 - find the culprit below
        logger.warning("%s failed on a batch of %d requests; retrying them one by one", what, len(requests),
                       exc_info=True)
    for g, state in zip(generators, states):
        g.set_state(state)
    results, start = [], 0
    for request, n in zip(requests, rows_each, strict=True):
        try:
            results.append(fn(logits[start:start + n], [request], [n])[0])
        except Exception as exc:  # noqa: BLE001 - this request's fault only
            errors[request.request_id] = (f"{what} on worker rank 0", f"{type(exc).__name__}: {exc}")
            results.append(None)
        start += n
    return results
