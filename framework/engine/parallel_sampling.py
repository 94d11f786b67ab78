"""Parallel sampling: one request with ``SamplingParams.n > 1`` runs as ``n`` sequences (vLLM V1's
``ParentRequest``, ``vllm/v1/engine/parallel_sampling.py``).

The engine fans a parent request out into ``n`` child requests with ids ``"{i}_{parent_id}"`` (vLLM's
child id format); to the scheduler, runner and lifecycle hooks they are ordinary requests (the metrics
count sequences, as vLLM's do). Child ``i`` samples with ``seed + i`` when the parent has a seed (vLLM's
rule: ``n=4, seed=s`` returns four samples, sample ``i`` equal to the same request sent alone with
``n=1, seed=s + i``), else from the engine's generator, so the samples differ either way. Only child 0
computes prompt logprobs; the others read the prompt's KV blocks from the prefix cache, which child 0
published when it was admitted (same-step hits, ``KVAllocator.allocate_slots``): every full block of the
prompt is computed once and shared by the ``n`` sequences (only the last, partial block is per
sequence). Without prefix caching each sequence computes its own prompt.

:class:`ParentRequest` merges the children's outputs back into the parent's: one ``RequestOutput`` per
engine step that carries the completions that changed (``DELTA``/``CUMULATIVE``), or all ``n`` at the
end (``FINAL_ONLY``), each with its ``index``; ``finished`` once every child finished.
"""

from __future__ import annotations

import dataclasses

from framework.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """The engine request id of sequence ``index`` of ``parent_id`` (vLLM's ``f"{index}_{parent_id}"``)."""
    return f"{index}_{parent_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sampling params of sequence ``index``: ``n=1``, seed ``seed + index`` when seeded, and prompt logprobs
    on sequence 0 only (the others then read the prompt from the prefix cache).

    Raises:
        ValueError: the derived seed leaves the accepted range (from ``SamplingParams.validate``).
    """
    return dataclasses.replace(
        params, n=1, seed=None if params.seed is None else params.seed + index,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class ParentRequest:
    """The caller's view of one ``n > 1`` request while its children run.

    Args:
        request_id: the caller's id.
        params: the caller's sampling params (``n`` sequences, ``output_kind``).
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.kind = params.output_kind
        self.child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        self._index = {cid: i for i, cid in enumerate(self.child_ids)}
        self._latest: dict[int, CompletionOutput] = {}  # index -> its latest (FINAL_ONLY: final) completion
        self._finished: set[int] = set()
        self._metrics: dict[int, RequestMetrics] = {}
        self._cached_tokens = 0  # prompt tokens served from the prefix cache, over finished children
        self._prompt_logprobs: list | None = None  # sequence 0's
        self._error: tuple[str, bool] | None = None  # the first child error: (message, internal)

    @property
    def finished(self) -> bool:
        """True once every child finished."""
        return len(self._finished) == len(self.child_ids)

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput | None:
        """The parent's output for its children's outputs of one engine step (any order, each child at most
        once), or ``None`` when there is nothing to report yet (``FINAL_ONLY`` before the last child finishes).

        Args:
            outputs: child ``RequestOutput``s (ids from :attr:`child_ids`), each with one completion.
        """
        changed = []
        first = outputs[0]
        for out in outputs:
            index = self._index[out.request_id]
            completion = dataclasses.replace(out.outputs[0], index=index)
            self._latest[index] = completion
            changed.append(completion)
            if out.prompt_logprobs is not None:
                self._prompt_logprobs = out.prompt_logprobs
            if out.error is not None and self._error is None:
                self._error = (out.error, out.internal_error)
            if out.finished:
                self._finished.add(index)
                if out.metrics is not None:
                    self._metrics[index] = out.metrics
                self._cached_tokens += out.num_cached_tokens or 0
        finished = self.finished
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            changed = list(self._latest.values())
        prompt_logprobs = self._prompt_logprobs
        if self.kind is RequestOutputKind.DELTA:  # sent once, with sequence 0's first output
            prompt_logprobs = next((o.prompt_logprobs for o in outputs if self._index[o.request_id] == 0), None)
        error, internal = self._error or (None, False)
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=sorted(changed, key=lambda c: c.index), finished=finished,
            metrics=self._metrics.get(0, next(iter(self._metrics.values()), None)) if finished else None,
            error=error, internal_error=internal, prompt_logprobs=prompt_logprobs,
            num_cached_tokens=self._cached_tokens if finished else None)


class ParallelRequests:
    """The engine's ``n > 1`` requests: parents by id, the parent of each child id, and the mapping of
    child outputs to the caller's (owned by ``LLMEngine``)."""

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def add(self, parent: ParentRequest) -> None:
        """Track ``parent`` until its last child finished."""
        self._parents[parent.request_id] = parent
        self._parent_of.update(dict.fromkeys(parent.child_ids, parent))

    def expand(self, request_ids: list[str]) -> list[str]:
        """``request_ids`` with each parent id replaced by its child ids (abort a parent: abort its sequences)."""
        return [cid for rid in request_ids
                for cid in (self._parents[rid].child_ids if rid in self._parents else [rid])]

    def to_caller(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs of one engine call merged into one output per parent (at the place of its first
        child), other outputs unchanged; a parent whose last child finished is forgotten."""
        if not self._parents:
            return outputs
        order: list[RequestOutput | ParentRequest] = []
        children: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            if parent is None:
                order.append(out)
            else:
                if parent.request_id not in children:
                    children[parent.request_id] = []
                    order.append(parent)
                children[parent.request_id].append(out)
        result = []
        for item in order:
            if isinstance(item, RequestOutput):
                result.append(item)
                continue
            merged = item.merge(children[item.request_id])
            if item.finished:
                del self._parents[item.request_id]
                for cid in item.child_ids:
                    self._parent_of.pop(cid, None)
            if merged is not None:
                result.append(merged)
        return result
