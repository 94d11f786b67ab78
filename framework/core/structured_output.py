"""Structured-output manager: compile cache, off-loop compilation, per-step bitmask, matcher advance.

Follows vLLM V1's ``StructuredOutputManager`` (``vllm/v1/structured_output/__init__.py``): grammars
compile on a thread pool, a request waits outside the scheduler until its grammar is ready, the
driver fills one ``(num_rows, ceil(vocab / 32))`` int32 bitmask per step before the forward and the
driver rank's runner applies it to the logits before sampling, and
the engine advances each matcher on the tokens the scheduler actually appended.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from framework.core.outputs import SchedulerOutput
from framework.core.request import Request
from framework.interfaces import Grammar, GrammarMatcher

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                        mask_rows: list[int] | None = None) -> None:
    """Set disallowed tokens of ``logits[rows]`` to ``-inf``, in place.

    Args:
        logits: (num_rows, num_cols) any float dtype, any device; ``num_cols`` may exceed the
            bitmask's ``32 * words`` (padded vocabulary): those columns are disallowed.
        bitmask: (num_mask_rows, words) int32 CPU, bit ``t % 32`` of word ``t // 32`` set = token allowed.
        rows: the rows to mask (others are untouched).
        mask_rows: the bitmask row of each of ``rows`` (default: ``rows``).
    """
    if not rows:
        return
    idx = torch.tensor(rows, dtype=torch.long)
    mask_idx = idx if mask_rows is None else torch.tensor(mask_rows, dtype=torch.long)
    bits = (bitmask[mask_idx].unsqueeze(-1) >> _BIT_SHIFTS) & 1  # (len(rows), words, 32)
    allowed = bits.reshape(len(rows), -1).bool()
    num_cols = logits.shape[1]
    if allowed.shape[1] >= num_cols:
        allowed = allowed[:, :num_cols]
    else:
        pad = torch.zeros(len(rows), num_cols - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad], dim=1)
    dev_idx = idx.to(logits.device)
    logits[dev_idx] = logits[dev_idx].masked_fill(~allowed.to(logits.device), float("-inf"))


class StructuredOutputManager:
    """Owns compiled grammars (cached per ``(kind, spec)``) and one matcher per request.

    Args:
        grammar: the engine's grammar plugin.
        vocab_size: model vocabulary (logits columns the sampler keeps), tokens.
        max_workers: compile threads (the engine loop never compiles).
    """

    def __init__(self, grammar: Grammar, vocab_size: int, max_workers: int = 1) -> None:
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.num_words = math.ceil(vocab_size / 32)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: dict[tuple[str, str], Future] = {}
        self._pending: dict[str, Future] = {}  # request_id -> compile future
        self.matchers: dict[str, GrammarMatcher] = {}  # request_id -> matcher
        self._num_advanced: dict[str, int] = {}  # request_id -> output tokens the matcher consumed

    def submit(self, request: Request) -> None:
        """Start (or reuse) compilation of the request's constraint on the thread pool."""
        key = request.sampling_params.structured_outputs.kind_and_spec()
        if key not in self._cache:
            self._cache[key] = self._pool.submit(self.grammar.compile, *key)
        self._pending[request.request_id] = self._cache[key]

    def is_ready(self, request_id: str) -> bool:
        """True once the request's grammar finished compiling (successfully or not)."""
        return self._pending[request_id].done()

    def wait_any(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds for any pending compile (used when nothing else can run)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self._pending:
            wait(list(self._pending.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def start(self, request: Request) -> str | None:
        """Create the request's matcher from its compiled grammar; returns an error text instead if
        compilation failed (the request must then be aborted)."""
        future = self._pending.pop(request.request_id)
        try:
            matcher = self.grammar.matcher(future.result())
        except ValueError as e:
            return str(e)
        self.matchers[request.request_id] = matcher
        self._num_advanced[request.request_id] = 0
        return None

    def discard(self, request_id: str) -> None:
        """Forget a finished or aborted request."""
        self._pending.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self._num_advanced.pop(request_id, None)

    def grammar_bitmask(self, so: SchedulerOutput) -> tuple[np.ndarray | None, dict[str, int]]:
        """The step's grammar bitmask, computed on the driver before the forward (vLLM V1's
        ``get_grammar_bitmask``) and shipped to the driver rank with the step's message.

        Every constrained request that samples this step (its scheduled tokens reach its end) gets
        one row, or ``k + 1`` rows when it verifies ``k`` drafts: row ``j`` is the mask after its
        output plus ``drafts[:j]`` (:meth:`fill_draft_bitmask`; rows past the longest valid draft
        prefix stay all-allowed, drafts having been cut to that prefix when proposed).

        Returns:
            ``(bitmask, first_row)``: ``(num_rows, ceil(vocab / 32))`` int32 (``None`` when no
            constrained request samples) and request_id -> its first row.
        """
        blocks: list[tuple[str, list[int]]] = []
        first_row: dict[str, int] = {}
        num_rows = 0
        for request in so.scheduled_requests:
            rid = request.request_id
            if rid not in self.matchers:
                continue
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            if request.num_computed_tokens + so.num_scheduled_tokens[rid] != request.num_tokens + len(drafts):
                continue  # a prefill chunk that does not reach the end samples nothing
            first_row[rid] = num_rows
            blocks.append((rid, drafts))
            num_rows += len(drafts) + 1
        if not blocks:
            return None, {}
        bitmask = torch.full((num_rows, self.num_words), -1, dtype=torch.int32)
        for rid, drafts in blocks:
            if drafts:
                self.fill_draft_bitmask(bitmask, first_row[rid], rid, drafts)
            else:
                self.matchers[rid].fill_bitmask(bitmask, first_row[rid])
        return bitmask.numpy(), first_row

    def fill_draft_bitmask(self, bitmask: torch.Tensor, first_row: int, request_id: str,
                           draft_token_ids: list[int]) -> int:
        """Speculative decoding: fill rows ``first_row .. first_row + n`` of ``bitmask`` with the
        masks after accepting ``draft_token_ids[:j]`` for ``j = 0..n`` (``n`` = the longest valid
        draft prefix), then roll the matcher back so its state is unchanged.

        Returns:
            ``n``; the caller truncates the draft to ``draft_token_ids[:n]`` (the verify rows of the
            rest would be fully masked).
        """
        matcher = self.matchers[request_id]
        n = matcher.validate_tokens(draft_token_ids)
        for j in range(n + 1):
            matcher.fill_bitmask(bitmask, first_row + j)
            if j < n:
                matcher.accept_token(draft_token_ids[j])
        matcher.rollback(n)
        return n

    def valid_draft_prefix(self, request_id: str, draft_token_ids: list[int]) -> list[int]:
        """The longest prefix of ``draft_token_ids`` the request's grammar accepts from its current
        state (unconstrained requests: the whole draft). Does not advance the matcher."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return draft_token_ids
        return draft_token_ids[:matcher.validate_tokens(draft_token_ids)]

    def advance(self, request: Request) -> tuple[bool, str | None]:
        """Feed the matcher the output tokens appended since the last call.

        Returns:
            ``(terminated, error)``: whether the grammar reached its end, and an error text when an
            appended token violates the grammar (the request must then be aborted).
        """
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            return False, None
        start = self._num_advanced[request.request_id]
        for token_id in request.output_token_ids[start:]:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                return False, f"token {token_id} violates the request's structured-output grammar"
        self._num_advanced[request.request_id] = request.num_output_tokens
        return matcher.is_terminated(), None

    def shutdown(self) -> None:
        """Stop the compile threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def num_pending(self) -> int:
        """Requests whose grammar is still compiling or not yet started."""
        return len(self._pending)

    def pending_ids(self) -> list[str]:
        """Ids of requests waiting for their grammar."""
        return list(self._pending)

    def __contains__(self, request_id: Any) -> bool:
        return request_id in self._pending or request_id in self.matchers
