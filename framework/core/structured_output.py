"""Structured-output manager: compile cache, off-loop compilation, per-step bitmask, matcher advance.

Follows vLLM V1's ``StructuredOutputManager`` (``vllm/v1/structured_output/__init__.py``): grammars
compile on a thread pool, a request waits outside the scheduler until its grammar is ready, the
driver fills one ``(num_rows, ceil(vocab / 32))`` int32 bitmask per step before the forward and the
driver rank's runner applies it to the logits before sampling, and
the engine advances each matcher on the tokens the scheduler actually appended.

Every per-request method runs its matcher under ``faults`` (``framework.core.faults``): a matcher that
raises, or a token its grammar refuses, fails that request only (the engine aborts it with the error);
its row is left unmasked, and its sampled token is dropped with the abort.
"""

from __future__ import annotations

import math
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from framework.core.faults import RequestFaults
from framework.core.grammar_trees import fill_tree_bitmask, valid_tree_nodes
from framework.core.outputs import SchedulerOutput
from framework.core.request import Request
from framework.core.spec_tree import DraftTree, tree_depths
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

    Attributes:
        faults: where per-request matcher failures are recorded; the engine replaces it with the one it
            shares with the scheduler.
    """

    def __init__(self, grammar: Grammar, vocab_size: int, max_workers: int = 1) -> None:
        self.grammar = grammar
        self.faults = RequestFaults()
        self._plugin = f"grammar {getattr(grammar, 'name', '') or type(grammar).__name__!r}"  # names it in errors
        self._what = f"{self._plugin} matcher"
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

        if self._pending:
            wait(list(self._pending.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def start(self, request: Request) -> str | None:
        """Create the request's matcher from its compiled grammar; returns an error text instead if the
        constraint is invalid (the compiler raised ``ValueError``: the request must be rejected). Any other
        exception of the compiler or the matcher is a fault of the grammar plugin, recorded in ``faults``."""
        future = self._pending.pop(request.request_id)
        with self.faults.guard(request.request_id, self._plugin):
            try:
                compiled = future.result()
            except ValueError as e:
                return str(e)
            self.matchers[request.request_id] = self.grammar.matcher(compiled)
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
        prefix stay all-allowed, drafts having been cut to that prefix when proposed); for a token tree
        row ``i + 1`` is the mask after node ``i``'s root-to-node path
        (``framework/core/grammar_trees.py``).

        A matcher that raises fails its request (``faults``; its rows stay all-allowed and the engine
        drops its sampled token with the abort); a row that allows no token rejects its request
        (:meth:`_reject_dead_ends`).

        Returns:
            ``(bitmask, first_row)``: ``(num_rows, ceil(vocab / 32))`` int32 (``None`` when no
            constrained request samples) and request_id -> its first row.
        """
        blocks: list[tuple[Request, list[int]]] = []
        first_row: dict[str, int] = {}
        num_rows = 0
        for request in so.scheduled_requests:
            rid = request.request_id
            if rid not in self.matchers or self.faults.failed(rid):
                continue
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            if request.num_computed_tokens + so.num_scheduled_tokens[rid] != request.num_tokens + len(drafts):
                continue  # a prefill chunk that does not reach the end samples nothing
            first_row[rid] = num_rows
            blocks.append((request, drafts))
            num_rows += len(drafts) + 1
        if not blocks:
            return None, {}
        bitmask = torch.full((num_rows, self.num_words), -1, dtype=torch.int32)
        rows: dict[int, tuple[Request, int]] = {}  # filled row -> (its request, output tokens before it)
        trees = so.scheduled_spec_decode_parents or {}
        for request, drafts in blocks:
            rid, start = request.request_id, first_row[request.request_id]
            if drafts and trees.get(rid):  # a token tree: each node's row masked after its own path
                depths = [0] + tree_depths(trees[rid]).tolist()
                offsets = self.faults.call(rid, self._what, fill_tree_bitmask, self.matchers[rid], bitmask, start,
                                           drafts, trees[rid], default=None) or []
                rows.update({start + j: (request, request.num_output_tokens + depths[j]) for j in offsets})
                continue
            if drafts:
                n = self.faults.call(rid, self._what, self.fill_draft_bitmask, bitmask, start, rid, drafts,
                                     default=None)
                filled = (n or 0) + 1
            else:
                with self.faults.guard(rid, self._what):
                    self.matchers[rid].fill_bitmask(bitmask, start)
                filled = 1
            rows.update({start + j: (request, request.num_output_tokens + j) for j in range(filled)})
        self._reject_dead_ends(bitmask, rows)
        for request, drafts in blocks:  # a failed request's rows mask nothing: its token is dropped anyway
            if self.faults.failed(request.request_id):
                start = first_row[request.request_id]
                bitmask[start:start + len(drafts) + 1] = -1
        return bitmask.numpy(), first_row

    def _reject_dead_ends(self, bitmask: torch.Tensor, rows: dict[int, tuple[Request, int]]) -> None:
        """Reject (not fault) the request of a row that allows no token: an unsatisfiable constraint (e.g.
        ``root ::= root``), or one that allows only stop tokens while ``min_tokens`` masks them. Either way the
        request's own parameters are at fault; sampling would pick a token the grammar refuses.

        ``rows``: bitmask row -> (its request, the request's output tokens before that row).
        """
        rows = {i: v for i, v in rows.items() if not self.faults.failed(v[0].request_id)}
        if not rows:
            return
        idx = list(rows)
        tail = self.vocab_size % 32
        any_allowed = (bitmask[idx, :self.vocab_size // 32] != 0).any(dim=1)
        if tail:
            any_allowed |= (bitmask[idx, self.vocab_size // 32] & ((1 << tail) - 1)) != 0
        for i, ok in zip(idx, any_allowed.tolist()):
            request, num_output = rows[i]
            params = request.sampling_params
            if ok and num_output < params.min_tokens and not self._allows_non_stop(bitmask[i], request):
                self.faults.reject(request.request_id, f"the structured-output constraint allows only stop tokens here, "
                                   f"which min_tokens={params.min_tokens} forbids; lower min_tokens or change the "
                                   "constraint")
            elif not ok:
                self.faults.reject(request.request_id, "the structured-output constraint allows no token here (it "
                                   "cannot be satisfied); fix the schema, regex, choices or grammar")

    def _allows_non_stop(self, row: torch.Tensor, request: Request) -> bool:
        """Whether bitmask ``row`` allows a token that ``min_tokens`` does not mask (``sampler.apply_min_tokens``)."""
        params = request.sampling_params
        allowed = ((row.unsqueeze(-1) >> _BIT_SHIFTS) & 1).reshape(-1)[:self.vocab_size].bool()
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
        allowed[[t for t in stop if 0 <= t < self.vocab_size]] = False
        return bool(allowed.any())

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
        return draft_token_ids[:self.faults.call(request_id, self._what, matcher.validate_tokens, draft_token_ids,
                                                 default=0)]

    def valid_draft_tree(self, request_id: str, tree: DraftTree) -> DraftTree:
        """The nodes of ``tree`` whose root-to-node path the request's grammar accepts from its current state
        (unconstrained requests: the whole tree; a matcher that raises: no node). Does not advance the matcher."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return tree
        keep = self.faults.call(request_id, self._what, valid_tree_nodes, matcher, tree.token_ids, tree.parents,
                                default=[])
        return tree.kept(keep)

    def advance(self, request: Request) -> bool:
        """Feed the matcher the output tokens appended since the last call; returns True when the grammar
        reached its end. A token the grammar refuses (the bitmask should have made that impossible) or a
        matcher exception is recorded in ``faults`` (the request must then be aborted)."""
        matcher = self.matchers.get(request.request_id)
        if matcher is None:
            return False
        return self.faults.call(request.request_id, self._what, self._advance, matcher, request, default=False)

    def _advance(self, matcher: GrammarMatcher, request: Request) -> bool:
        start = self._num_advanced[request.request_id]
        for token_id in request.output_token_ids[start:]:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(token_id):
                raise ValueError(f"token {token_id} violates the request's structured-output grammar")
        self._num_advanced[request.request_id] = request.num_output_tokens
        return matcher.is_terminated()

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


def apply_grammar_bitmask(logits: torch.Tensor, requests: list[Any], so: SchedulerOutput,
                          num_rows_each: int | list[int]) -> None:
    """Mask ``logits`` in place with the driver's grammar bitmask (``so.grammar_bitmask``).

    Args:
        logits: (sum of rows, >= vocab) float; request ``i`` owns ``num_rows_each[i]`` consecutive
            rows (1 when sampling plainly, k + 1 when verifying k drafts), as does its bitmask block
            starting at ``so.structured_output_request_ids[request_id]``.
        requests: the rows' requests; those without a bitmask block are untouched.
        num_rows_each: rows per request (an int for all).
    """
    counts = [num_rows_each] * len(requests) if isinstance(num_rows_each, int) else num_rows_each
    first = so.structured_output_request_ids
    rows, mask_rows, start = [], [], 0
    for request, n in zip(requests, counts, strict=True):
        if request.request_id in first:
            rows += range(start, start + n)
            mask_rows += range(first[request.request_id], first[request.request_id] + n)
        start += n
    if rows:
        apply_token_bitmask(logits, torch.from_numpy(so.grammar_bitmask), rows, mask_rows)
