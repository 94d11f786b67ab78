"""``/v1/completions`` choices from engine outputs, with vLLM's semantics for ``echo``, ``logprobs`` over the
prompt and the output, ``max_tokens: 0`` and ``best_of`` (what lm-evaluation-harness' ``local-completions``
sends: ``echo: true, logprobs: k, max_tokens: 0 or 1``, and reads the prompt tokens' ``token_logprobs``).

- ``echo``: each choice's ``text`` is the prompt's text (as sent; token-id prompts decoded) followed by the
  completion, and its ``logprobs`` cover the prompt tokens first (the engine's prompt logprobs, requested as
  ``prompt_logprobs = logprobs``; the first token's are ``null``), then the generated ones.
- ``max_tokens: 0`` (only with ``echo``): the engine generates one token, which the response drops (vLLM
  does the same); ``usage.completion_tokens`` is 0.
- ``best_of > n``: the engine samples ``best_of`` sequences with their tokens' logprobs and the response
  keeps the ``n`` with the highest mean token logprob (OpenAI: "the highest log probability per token"),
  re-indexed ``0..n-1``; refused with ``stream``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.core.outputs import CompletionOutput, RequestOutput
from framework.entrypoints.server import responses as R
from framework.entrypoints.server.protocol import CompletionRequest
from framework.entrypoints.server.serving import EngineJob, RequestError


def engine_fields(req: CompletionRequest) -> tuple[int | None, int | None, int, int | None]:
    """``(max_tokens, logprobs, n, prompt_logprobs)`` to ask the engine for.

    Raises:
        RequestError(400): ``max_tokens`` 0 without ``echo``, ``best_of`` < ``n``, ``best_of`` with ``stream``.
    """
    if req.max_tokens == 0 and not req.echo:
        raise RequestError("max_tokens must be at least 1 (0 only with echo=true: the prompt's logprobs alone)",
                           param="max_tokens")
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise RequestError(f"best_of ({best_of}) must be >= n ({req.n})", param="best_of")
    if best_of > req.n and req.stream:
        raise RequestError("best_of cannot be used with stream=true (the best completions are known only at the end)",
                           param="best_of")
    logprobs = req.logprobs
    if best_of > req.n and logprobs is None:
        logprobs = 0  # the ranking needs the sampled tokens' logprobs; not returned
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
    return max_tokens, logprobs, best_of, (req.logprobs if req.echo and req.logprobs is not None else None)


@dataclass
class CompletionChoices:
    """Builds the choices of one completions request (non-streamed: :meth:`final`; streamed: :meth:`chunk`).

    Args:
        req: the request body.
        tokenizer: the served model's tokenizer (token texts; decoding token-id prompts when echoing).
        prompt_texts: per prompt, the text as sent (``None`` for a token-id prompt: decoded when echoed).
    """

    req: CompletionRequest
    tokenizer: Any
    prompt_texts: list[str | None]
    # streaming state per choice index: (text offset, previous token id), and per prompt the prompt
    # logprobs once known and the outputs held until then (echo + logprobs: the first sequence to finish its
    # prefill may not be the one computing the prompt's logprobs)
    _seen: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    _prompt_lps: dict[int, list] = field(default_factory=dict)
    _held: dict[int, list[RequestOutput]] = field(default_factory=dict)

    @property
    def drops_output(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the one generated token is not returned."""
        return self.req.max_tokens == 0

    def num_completion_tokens(self, out: RequestOutput) -> int:
        """Generated tokens of ``out`` that the response returns (usage)."""
        return 0 if self.drops_output else sum(len(c.token_ids) for c in out.outputs)

    def _prompt_text(self, job: EngineJob) -> str:
        text = self.prompt_texts[job.index]
        return self.tokenizer.decode(job.prompt_token_ids) if text is None else text

    def final(self, job: EngineJob, out: RequestOutput) -> list[dict[str, Any]]:
        """The ``n`` choices of one prompt from its final output."""
        completions = out.outputs
        if len(completions) > self.req.n:  # best_of
            completions = sorted(completions, key=_mean_logprob, reverse=True)[:self.req.n]
        return [self._choice(job.index * self.req.n + i, job, c, out.prompt_logprobs, first=True)
                for i, c in enumerate(completions)]

    def chunk(self, job: EngineJob, out: RequestOutput) -> list[dict[str, Any]]:
        """The choices of one streamed (DELTA) output; a choice's first chunk carries the echoed prompt."""
        if self.req.echo and self.req.logprobs is not None and job.index not in self._prompt_lps:
            if out.prompt_logprobs is None:
                self._held.setdefault(job.index, []).append(out)
                return []
            self._prompt_lps[job.index] = out.prompt_logprobs
            return [c for o in [*self._held.pop(job.index, []), out] for c in self._chunk_choices(job, o)]
        return self._chunk_choices(job, out)

    def _chunk_choices(self, job: EngineJob, out: RequestOutput) -> list[dict[str, Any]]:
        choices = []
        for c in out.outputs:
            index = job.index * self.req.n + c.index
            first = index not in self._seen
            if not (c.text or c.token_ids or c.finish_reason or first):
                continue
            choices.append(self._choice(index, job, c, self._prompt_lps.get(job.index), first))
        return choices

    def _choice(self, index: int, job: EngineJob, c: CompletionOutput, prompt_lps: list | None,
                first: bool) -> dict[str, Any]:
        """One choice (or chunk choice): the echoed prompt when ``first``, then the completion's text and logprobs."""
        offset, prev_id = self._seen.get(index, (0, job.prompt_token_ids[-1]))
        ids, entries = ([], []) if self.drops_output else (list(c.token_ids), list(c.logprobs or []))
        text = "" if self.drops_output else c.text
        if self.req.echo and first:
            prev_id = None
            prompt_entries = prompt_lps if prompt_lps is not None else [None] * len(job.prompt_token_ids)
            ids, entries, text = job.prompt_token_ids + ids, list(prompt_entries) + entries, self._prompt_text(job) + text
        logprobs, next_offset = None, offset + len(text)
        if self.req.logprobs is not None:
            logprobs = R.completion_logprobs(self.tokenizer, ids, entries, self.req.logprobs, offset, prev_id)
            if ids:  # offsets count token texts (a prompt's special tokens have text the echoed prompt lacks)
                next_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        self._seen[index] = (next_offset, ids[-1] if ids else prev_id)
        return R.completion_choice(index, c, logprobs, text=text)


def _mean_logprob(c: CompletionOutput) -> float:
    """Mean logprob of the sampled tokens of ``c`` (``best_of``'s ranking)."""
    lps = [entry[t] for t, entry in zip(c.token_ids, c.logprobs or []) if t in entry]
    return sum(lps) / len(lps) if lps else float("-inf")
