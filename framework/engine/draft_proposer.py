"""The engine's calls into its drafter (speculative decoding, ``spec_decode=...``), faults kept per request.

:class:`DraftProposer` runs after each step's update: it hands the drafter the target's hidden states (EAGLE asks for
them), tells it which requests left, and asks it for drafts for the running requests in their decode phase, capped so
that verifying them never passes ``max_model_len`` or ``max_tokens`` and cut to the prefix a request's grammar accepts.
The scheduler verifies the drafts in the next step (vLLM V1's ``spec_token_ids``); a draft never changes an output.

A drafter may propose a token tree (``framework.core.spec_tree.DraftTree``) instead of a chain: it is pruned to the
depth and the KV slots the request has room for, and for a request with a grammar to the nodes whose path the grammar
accepts (each node's verify row then gets its own path's mask: ``framework/core/grammar_trees.py``). A chain-shaped
tree is sent as a chain.
"""

from __future__ import annotations

import logging
from numbers import Integral
from typing import Any

from framework.core.clock import Clock
from framework.core.faults import RequestFaults
from framework.core.outputs import ModelRunnerOutput
from framework.core.request import Request
from framework.core.scheduler import Scheduler
from framework.core.spec_tree import DraftTree
from framework.core.structured_output import StructuredOutputManager
from framework.interfaces import Drafter

logger = logging.getLogger(__name__)


class DraftProposer:
    """One engine's drafter calls.

    Args:
        drafter: the drafter plugin (``framework.interfaces.Drafter``).
        scheduler: the engine's scheduler (its running requests get ``spec_token_ids``).
        faults: the engine's per-request fault record (a request whose own ``propose`` raises, or whose draft holds
            a token id outside the vocabulary, fails alone).
        clock: the engine's clock (the drafter's time in each step's stats, seconds).
        vocab_size: the target's vocabulary size, token ids.
        max_model_len: prompt + output cap, tokens.
        structured_output: the grammar manager, when structured outputs are on (drafts cut to what a grammar accepts).
    """

    def __init__(self, drafter: Drafter, scheduler: Scheduler, faults: RequestFaults, clock: Clock, vocab_size: int,
                 max_model_len: int, structured_output: StructuredOutputManager | None = None) -> None:
        self.drafter, self.scheduler, self.faults, self.clock = drafter, scheduler, faults, clock
        self.vocab_size, self.max_model_len, self.structured_output = vocab_size, max_model_len, structured_output

    def propose(self, sched_out: Any, runner_out: ModelRunnerOutput, updated: list[Request]) -> float:
        """After a step's update: hand the drafter the step's target hidden states (when it asked for them), tell
        it which requests left, then draft for running requests in their decode phase (all tokens but the last
        computed), setting each one's ``spec_token_ids``. Drafts are capped so that verifying them can reach neither
        ``max_model_len`` nor ``max_tokens``, and cut to the prefix the request's grammar accepts (structured
        outputs). A request whose drafts fail is recorded in ``faults`` (the engine aborts it).

        Args:
            sched_out: the step's ``SchedulerOutput``.
            runner_out: its ``ModelRunnerOutput`` (``hidden_states``: ``(num_tokens, hidden)`` of the target, or None).
            updated: the requests the step's update touched.

        Returns:
            The drafter's time, seconds (the engine's clock).
        """
        t0 = self.clock.now()
        if runner_out.hidden_states is not None:
            self.call("observe_hidden_states", runner_out.hidden_states)
        # finished this step (length/stop/grammar) or preempted; aborts are told in abort_request
        gone = (sched_out.preempted_req_ids | sched_out.finished_req_ids
                | {r.request_id for r in updated if r.is_finished})
        if gone:
            self.call("on_requests_freed", gone)
        decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        if decoding:
            drafts = self.drafts(decoding)
            for request in decoding:
                self.set_drafts(request, drafts.get(request.request_id, DraftTree([], [])))
        return self.clock.now() - t0

    def set_drafts(self, request: Request, tree: DraftTree) -> None:
        """Set ``request.spec_token_ids`` (and ``spec_parents`` for a tree) from its proposal: capped so that
        verifying it reaches neither ``max_model_len`` nor ``max_tokens``, cut to the nodes (the prefix, for a chain)
        the request's grammar accepts."""
        max_tokens = request.sampling_params.max_tokens or self.max_model_len
        room = min(self.max_model_len - request.num_tokens, max_tokens - request.num_output_tokens) - 1
        tree = tree.pruned(max_depth=room, max_nodes=self.max_model_len - request.num_tokens - 1)
        if self.structured_output is not None and not tree.is_chain:
            tree = self.structured_output.valid_draft_tree(request.request_id, tree)
        draft = list(tree.token_ids)
        if tree.is_chain:
            if self.structured_output is not None and draft:
                draft = self.structured_output.valid_draft_prefix(request.request_id, draft)
            request.spec_token_ids, request.spec_parents = draft, []
        else:
            request.spec_token_ids, request.spec_parents = draft, list(tree.parents)

    def drafts(self, requests: list[Request]) -> dict[str, DraftTree]:
        """``drafter.propose(requests)`` as trees (a list of ids is a chain), with faults kept to the request they
        belong to: when the batched call raises, each request is proposed for alone and only those whose own call
        raises fail (their error names the drafter); a draft token outside ``[0, vocab_size)`` fails its request
        too (it would index out of the embedding table in the next forward)."""
        what = f"drafter {self.drafter.name!r}"
        try:
            drafts = dict(self.drafter.propose(requests))
        except Exception:  # noqa: BLE001 - find the culprit(s) below
            drafts = {}
            for request in requests:
                with self.faults.guard(request.request_id, what):
                    drafts.update(self.drafter.propose([request]))
        for request in requests:
            with self.faults.guard(request.request_id, what):
                draft = drafts.get(request.request_id) or []
                tree = draft if isinstance(draft, DraftTree) else DraftTree.chain(list(draft))
                bad = [t for t in tree.token_ids if not (isinstance(t, Integral) and 0 <= t < self.vocab_size)]
                if bad:
                    raise ValueError(f"proposed token id {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")
                drafts[request.request_id] = tree
        return {rid: d for rid, d in drafts.items() if not self.faults.failed(rid)}

    def call(self, method: str, arg: Any) -> None:
        """A drafter bookkeeping call that belongs to no single request (``observe_hidden_states``,
        ``on_requests_freed``): an exception is logged and the step goes on (at worst later drafts are worse;
        drafts never change outputs, the target verifies them)."""
        try:
            getattr(self.drafter, method)(arg)
        except Exception:  # noqa: BLE001 - see the docstring
            logger.exception("drafter %r raised in %s; continuing (drafts are verified, outputs are unaffected)",
                             self.drafter.name, method)

