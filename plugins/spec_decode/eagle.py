"""EAGLE drafter: an EAGLE-1 head over the target's last hidden states drafts k tokens greedily.

Li et al., ICML 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(Sec. 3; the head itself is in :mod:`plugins.spec_decode._eagle_head`). The model runner keeps the
target's last hidden states of every forward (``Drafter.needs_hidden_states``), so the target runs
once per step. Head position ``j`` of a request pairs the target feature at position
``start + j`` with the token sampled from it; the head has its own attention backend instance,
paged KV cache (its own layer count) and block pool, and runs flattened batches through a second
:class:`framework.worker.model_runner.ModelRunner`'s input preparation.

Per request the drafter keeps the features the head has not consumed yet. Each ``propose`` first
catches the head's KV up on the real features (positions below ``num_computed_tokens``; rows of
rejected drafts are dropped), then runs k single-token steps on its own predicted features. Draft
positions are never kept: the next catch-up overwrites them. Positions whose features the drafter
never saw (a prefix-cache hit, KV swapped back in after its state was dropped) are skipped: the
head's context starts at the first feature it saw. RoPE attention depends only on relative
positions, so head positions count from that start; acceptance may drop, output never changes.

Drafts are the head's argmax, so ``q`` is one-hot and verification is exact for every sampling
setting (``framework.sample.rejection_sampler``). With ``spec_decode.params.tree`` (static paths whose every rank but
the last is 0, :func:`framework.core.spec_tree.sibling_tree_paths`) the drafter proposes a token tree: its argmax
chain plus, at each depth, the head's next-best guesses as leaves (the LM head's top-k of the same steps). With
``spec_decode.params.tree=dynamic`` it grows EAGLE-2 dynamic trees (:mod:`plugins.spec_decode._eagle2_tree`:
``num_speculative_tokens`` deep, ``topk`` nodes expanded per depth, the ``num_draft_tokens`` most likely kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from framework import hookimpl
from framework.config import EngineConfig
from framework.core.outputs import SchedulerOutput, TargetHiddenStates
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.spec_tree import DraftTree, paths_parents, sibling_tree_paths, tree_from_ranked
from framework.hookspecs import Register
from framework.interfaces import Drafter
from plugins.spec_decode._eagle2_tree import grow_trees

MISSING_MODEL = ("spec_decode=eagle needs spec_decode.params.model=PATH of an EAGLE head "
                 "(e.g. models/stories260K-eagle; train one with python -m experiments.quality.train_eagle)")


@dataclass
class _HeadState:
    """One request's head KV (``shadow``: head position j = target position ``start + j``) and
    the target features not yet consumed."""

    start: int  # target position of head position 0
    shadow: Request  # head-side request: its tokens are the x_{i+1} of each pair, computed = pairs in head KV
    pending: torch.Tensor  # (n, hidden): target features of positions start + computed ... + n - 1


class EagleDrafter(Drafter):
    """``spec_decode=eagle spec_decode.params.model=PATH`` (a head in the EAGLE checkpoint layout).

    Args:
        num_speculative_tokens: k, tokens drafted per step.
        model: folder of the EAGLE head (``config.json`` + ``pytorch_model.bin``/``model.safetensors``),
            e.g. ``models/stories260K-eagle`` or the output of ``python -m experiments.quality.train_eagle``.
        num_blocks: head KV blocks; default enough for ``max_num_seqs`` requests of
            ``max_model_len`` tokens, capped by the target's ``kv_cache_memory_bytes``.
        tree: static Medusa-style paths, each rank but the last 0 (the chain plus top-k leaves per depth); the tree's
            depth replaces ``num_speculative_tokens``. ``"dynamic"``: EAGLE-2 trees ``num_speculative_tokens`` deep.
            ``None``: a chain.
        topk: with ``tree=dynamic``, nodes expanded per depth and children per expanded node (EAGLE-2's top-k).
        num_draft_tokens: with ``tree=dynamic``, the nodes kept after reranking (EAGLE-2's total tokens).

    Raises:
        ValueError: no model given, a tree the drafter cannot fill, or ``topk``/``num_draft_tokens`` < 1 (also
            reported by :meth:`validate`).
    """

    name = "eagle"
    needs_hidden_states = True
    drafts_trees = True

    def __init__(self, num_speculative_tokens: int = 4, model: str | None = None, num_blocks: int | None = None,
                 tree: Any = None, topk: int = 4, num_draft_tokens: int = 16, **params: Any) -> None:
        super().__init__(num_speculative_tokens, **params)
        if not model:
            raise ValueError(MISSING_MODEL)
        problem = _dynamic_problem(tree, topk, num_draft_tokens)
        if problem:
            raise ValueError(problem)
        self.dynamic = tree == "dynamic"
        self.paths = sibling_tree_paths(tree, "eagle") if tree is not None and not self.dynamic else None
        if self.dynamic:
            self.topk, self.num_draft_tokens = int(topk), int(num_draft_tokens)
        if self.paths is not None:
            self.parents = paths_parents(self.paths)
            self.num_speculative_tokens = max(len(p) for p in self.paths)
            self.topk = max(p[-1] for p in self.paths) + 1
        self.model_path = model
        self.num_blocks = num_blocks
        self._states: dict[str, _HeadState] = {}

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Head folder given and readable; its hidden size and vocabulary equal the target's."""
        problems = super().validate(config)
        params = config.drafter_params
        tree = params.get("tree")
        problem = _dynamic_problem(tree, params.get("topk", 4), params.get("num_draft_tokens", 16))
        if problem:
            problems.append(problem)
        elif tree is not None and tree != "dynamic":
            try:
                sibling_tree_paths(tree, "eagle")
            except ValueError as exc:
                problems.append(str(exc))
        path = config.drafter_params.get("model")
        if not path:
            return problems + [MISSING_MODEL]
        from framework.model_executor.model_loader import load_model_config
        from plugins.spec_decode._eagle_head import load_head_config

        try:
            head = load_head_config(path)
            target = load_model_config(config.model)
        except (OSError, ValueError) as exc:
            return problems + [f"spec_decode=eagle: cannot read the EAGLE head {path!r} ({exc})"]
        return problems + _mismatches(head, target, path)

    def load(self, model: torch.nn.Module, model_config: Any, config: EngineConfig) -> None:
        """Load the head (sharing the target's embedding and LM head), its backend, KV cache and pool.

        Raises:
            ValueError: the head's hidden size or vocabulary differs from the target's.
        """
        from framework.model_executor.forward_context import register_attention_implementation
        from plugins.spec_decode._draft_runner import build_draft_runner
        from plugins.spec_decode._eagle_head import load_head, load_head_config

        problems = _mismatches(load_head_config(self.model_path), model_config, self.model_path)
        if problems:
            raise ValueError("; ".join(problems))
        self.head = load_head(self.model_path, model.get_input_embeddings(), getattr(torch, config.dtype),
                              torch.device(config.device), register_attention_implementation())
        self.lm_head = model.get_output_embeddings()
        max_len = config.max_model_len or model_config.max_position_embeddings
        self.kv, self.runner = build_draft_runner(self.head, self.head.config, config, max_len,
                                                  model_config.vocab_size, self.num_blocks)

    def observe_hidden_states(self, hidden_states: TargetHiddenStates) -> None:
        """Append each request's new target features to its pending ones (stale rows beyond the
        new rows' first position are dropped first)."""
        qsl, ctx = hidden_states.query_start_loc.tolist(), hidden_states.context_lens.tolist()
        for i, rid in enumerate(hidden_states.request_ids):
            rows = hidden_states.hidden_states[qsl[i]:qsl[i + 1]]
            state = self._states.get(rid)
            keep = -1 if state is None else ctx[i] - (state.start + state.shadow.num_computed_tokens)
            if 0 <= keep <= state.pending.shape[0]:  # rows before this step's first position stay
                state.pending = torch.cat([state.pending[:keep], rows])
            else:  # first features seen, a recompute, or a gap (never expected): the head starts here
                self._drop(rid)
                shadow = Request(request_id=rid, prompt_token_ids=[],
                                 sampling_params=SamplingParams(temperature=0.0, max_tokens=None))
                self._states[rid] = _HeadState(start=ctx[i], shadow=shadow, pending=rows.clone())

    def on_requests_freed(self, request_ids: Any) -> None:
        """Free the head KV blocks and pending features of finished, aborted or preempted requests."""
        for rid in request_ids:
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        state = self._states.pop(rid, None)
        if state is not None:
            self.kv.free(state.shadow)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> dict[str, list[int] | DraftTree]:
        """Catch the head up on real features, then k greedy draft steps over all requests at once (with a tree:
        the top-k of each step too, then each request's tree)."""
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        ranked: dict[str, list[list[int]]] = {r.request_id: [] for r in requests}
        active, feats, real, caught_up = [], {}, {}, {}
        for request in requests:
            state = self._states.get(request.request_id)
            if state is None:  # no target features seen yet (cannot happen after a forward): no draft
                continue
            shadow = state.shadow
            n_real = request.num_computed_tokens - state.start  # pairs whose feature is the target's
            new = n_real - shadow.num_computed_tokens
            if new <= 0 or new > state.pending.shape[0]:
                continue
            # pair j's token is x_{start + j + 1}; the kept prefix is accepted, so only append
            shadow.all_token_ids.extend(request.all_token_ids[state.start + 1 + shadow.num_tokens:request.num_tokens])
            feats[request.request_id] = state.pending[:new]
            real[request.request_id] = n_real
            active.append(state)
        root_features = {rid: f[-1] for rid, f in feats.items()}  # the last real pair's target feature
        root_hidden: dict[str, torch.Tensor] = {}
        for step in range(1 if self.dynamic else self.num_speculative_tokens):
            active = [s for s in active
                      if self.kv.allocate_slots(s.shadow, s.shadow.num_tokens - s.shadow.num_computed_tokens) is not None]
            if not active:
                break
            if step == 0:  # only these caught up; the others keep their pending features for later
                caught_up = {s.shadow.request_id: real[s.shadow.request_id] for s in active}
            hidden = self._head_step([s.shadow for s in active], feats)  # (len(active), hidden)
            if self.dynamic:  # the catch-up only; the trees grow from the last real pair's predicted feature
                for j, state in enumerate(active):
                    state.shadow.num_computed_tokens = state.shadow.num_tokens
                    root_hidden[state.shadow.request_id] = hidden[j]
                break
            logits = self.lm_head(hidden)  # one LM-head GEMM for every request
            if self.paths is not None:
                top = logits.topk(self.topk, dim=-1).indices.tolist()  # (len(active), topk), best first
                tokens = [t[0] for t in top]
            else:
                tokens = logits.argmax(-1).tolist()
            for j, state in enumerate(active):
                rid = state.shadow.request_id
                if self.paths is not None:
                    ranked[rid].append(top[j])
                state.shadow.num_computed_tokens = state.shadow.num_tokens
                state.shadow.all_token_ids.append(tokens[j])
                drafts[rid].append(tokens[j])
                feats[rid] = hidden[j:j + 1]  # the predicted next feature feeds the next step
        trees = {}
        if self.dynamic and caught_up:
            trees = grow_trees(self, {rid: self._states[rid].shadow for rid in caught_up}, root_features, root_hidden)
        for rid, n_real in caught_up.items():  # keep the real pairs' KV only; draft pairs get overwritten
            state = self._states[rid]
            state.pending = state.pending[:0]  # consumed; rows beyond were rejected drafts
            state.shadow.num_computed_tokens = n_real
            del state.shadow.all_token_ids[n_real:]
        if self.dynamic:
            return trees
        if self.paths is not None:
            return {rid: tree_from_ranked(self.paths, self.parents, ranked[rid]) for rid in drafts}
        return drafts

    def _head_step(self, shadows: list[Request], feats: dict[str, torch.Tensor]) -> torch.Tensor:
        """One flattened head forward over every shadow's uncomputed pairs; returns each shadow's
        last predicted feature, ``(len(shadows), hidden)`` in ``shadows`` order."""
        from framework.model_executor.forward_context import ForwardContext, forward_context

        n = {s.request_id: s.num_tokens - s.num_computed_tokens for s in shadows}
        so = SchedulerOutput(scheduled_requests=shadows, num_scheduled_tokens=n, total_num_scheduled_tokens=sum(n.values()),
                             block_ids={s.request_id: self.kv.get_block_tables(s.request_id) for s in shadows})
        batch = self.runner.prepare_inputs(so)
        features = torch.cat([feats[r.request_id] for r in batch.requests])[None]  # (1, num_tokens, hidden)
        metadata = self.runner.backend.build_metadata(batch.common)
        with forward_context(ForwardContext(self.runner.backend, metadata, self.runner.kv_caches)):
            out = self.head(batch.input_ids, batch.positions, features)[0]  # (num_tokens, hidden)
        last = out[batch.logits_index]  # (num_shadows, hidden), batch.sample_requests order
        row = {r.request_id: j for j, r in enumerate(batch.sample_requests)}
        return last[torch.tensor([row[s.request_id] for s in shadows], device=last.device)]


def _dynamic_problem(tree: Any, topk: Any, num_draft_tokens: Any) -> str | None:
    """Why ``tree=dynamic``'s parameters are unusable (None: fine, or no dynamic tree)."""
    if tree != "dynamic":
        return None
    for name, value in (("topk", topk), ("num_draft_tokens", num_draft_tokens)):
        if not isinstance(value, int) or value < 1:
            return (f"spec_decode=eagle tree=dynamic: {name} must be an integer >= 1, got {value!r}; e.g. "
                    "spec_decode.params.topk=4 spec_decode.params.num_draft_tokens=16")
    return None


def _mismatches(head: Any, target: Any, path: str) -> list[str]:
    """Reasons the EAGLE head cannot draft for the target (hidden size, vocabulary)."""
    problems = []
    if head.hidden_size != target.hidden_size:
        problems.append(f"spec_decode=eagle: the head {path!r} has hidden_size {head.hidden_size} but the target "
                        f"has {target.hidden_size}; use a head trained for this target "
                        "(python -m experiments.quality.train_eagle --model <target>)")
    if getattr(head, "vocab_size", target.vocab_size) != target.vocab_size:
        problems.append(f"spec_decode=eagle: the head {path!r} was made for vocabulary {head.vocab_size}, the "
                        f"target has {target.vocab_size}; the head must share the target's tokenizer")
    return problems


@hookimpl
def register_drafters(register: Register) -> None:
    """Register ``eagle``."""
    register("eagle", EagleDrafter)
