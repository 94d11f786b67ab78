"""Draft-model drafter: a smaller model with the same tokenizer proposes k tokens greedily.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et
al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"): the draft model
runs k cheap autoregressive steps, the target verifies them in one forward. The draft model has
its own attention backend instance, its own paged KV cache (its own layer count and head shape)
and its own block pool; it runs through a second :class:`framework.worker.model_runner.ModelRunner`, so
its steps are flattened batches like the target's. Its KV is kept across steps: after a verify
step only the longest common prefix of what it computed and the request's accepted tokens is
reused, the rest is recomputed (rejected positions are overwritten).

Drafts are greedy (the draft's argmax), so ``q`` is one-hot and verification is exact for any
sampling parameters (``framework.sample.rejection_sampler``). With ``spec_decode.params.tree`` (static paths whose
every rank but the last is 0, :func:`framework.core.spec_tree.sibling_tree_paths`) the drafter proposes a token tree:
its greedy chain plus, at each depth, the draft's next-best tokens as leaves (its top-k logprobs of the same steps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from framework import hookimpl
from framework.config import EngineConfig
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.spec_tree import DraftTree, paths_parents, sibling_tree_paths, tree_from_ranked
from framework.hookspecs import Register
from framework.interfaces import Drafter

MISSING_MODEL = "spec_decode=draft_model needs spec_decode.params.model=PATH (e.g. models/stories260K-draft)"


class DraftModelDrafter(Drafter):
    """``spec_decode=draft_model spec_decode.params.model=PATH``.

    Args:
        num_speculative_tokens: k, tokens drafted per step.
        model: path (or ``models/`` name) of the draft model; must share the target's vocabulary.
        num_blocks: draft KV blocks; default enough for ``max_num_seqs`` requests of
            ``max_model_len`` tokens, capped by the target's ``kv_cache_memory_bytes``.
        tree: static Medusa-style paths, each rank but the last 0 (the chain plus top-k leaves per depth); the tree's
            depth replaces ``num_speculative_tokens``. ``None``: a chain.

    Raises:
        ValueError: no model given, or a tree the drafter cannot fill (also reported by :meth:`validate`).
    """

    name = "draft_model"
    drafts_trees = True

    def __init__(self, num_speculative_tokens: int = 4, model: str | None = None, num_blocks: int | None = None,
                 tree: Any = None, **params: Any) -> None:
        super().__init__(num_speculative_tokens, **params)
        if not model:
            raise ValueError(MISSING_MODEL)
        self.paths = sibling_tree_paths(tree, "draft_model") if tree is not None else None
        self.topk: int | None = None  # top-k logprobs asked of each draft step (trees only)
        if self.paths is not None:
            self.parents = paths_parents(self.paths)
            self.num_speculative_tokens = max(len(p) for p in self.paths)
            self.topk = max(p[-1] for p in self.paths) + 1
        self.model_path = model
        self.num_blocks = num_blocks
        self._states: dict[str, Request] = {}  # request_id -> shadow request tracking the draft KV

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Model path given and present, its architecture runs on the chosen attention backend, and its
        vocabulary equals the target's (configs only)."""
        problems = super().validate(config)
        tree = config.drafter_params.get("tree")
        if tree is not None:
            try:
                sibling_tree_paths(tree, "draft_model")
            except ValueError as exc:
                problems.append(str(exc))
        path = config.drafter_params.get("model")
        if not path:
            return problems + [MISSING_MODEL]
        from framework import registry
        from framework.model_executor.model_families import UnsupportedModelError, attention_layers
        from framework.model_executor.model_loader import load_model_config

        try:
            draft = load_model_config(path)
            draft_vocab, target_vocab = draft.vocab_size, load_model_config(config.model).vocab_size
        except (OSError, ValueError) as exc:
            return problems + [f"spec_decode=draft_model: cannot read the draft model {path!r} ({exc}); "
                               "give an existing model folder in spec_decode.params.model"]
        try:  # the draft runs through the same attention backend: the same refusals apply to it
            problems += [f"spec_decode=draft_model: {p}" for p in
                         registry.get_class("attention", config.attention).validate_model(attention_layers(draft),
                                                                                           config)]
        except UnsupportedModelError as exc:
            problems.append(f"spec_decode=draft_model: the draft model {path!r}: {exc}")
        if draft_vocab != target_vocab:
            problems.append(f"spec_decode=draft_model: draft vocabulary {draft_vocab} != target vocabulary "
                            f"{target_vocab}; the draft model must share the target's tokenizer")
        return problems

    def load(self, model: torch.nn.Module, model_config: Any, config: EngineConfig) -> None:
        """Load the draft model, its attention backend, KV cache, block pool and runner."""
        from framework.model_executor.forward_context import register_attention_implementation
        from framework.model_executor.model_loader import load_model
        from plugins.spec_decode._draft_runner import build_draft_runner

        loaded = load_model(str(Path(self.model_path)), dtype=config.dtype, device=config.device,
                            attn_implementation=register_attention_implementation())
        mc = loaded.config
        if mc.vocab_size != model_config.vocab_size:
            raise ValueError(f"draft vocabulary {mc.vocab_size} != target vocabulary {model_config.vocab_size}")
        max_len = config.max_model_len or mc.max_position_embeddings
        self.max_len = min(max_len, mc.max_position_embeddings)  # draft positions stay below this
        self.kv, self.runner = build_draft_runner(loaded.model, mc, config, max_len, mc.vocab_size, self.num_blocks)

    def on_requests_freed(self, request_ids: Any) -> None:
        """Free the draft KV blocks of finished, aborted or preempted requests."""
        for rid in request_ids:
            state = self._states.pop(rid, None)
            if state is not None:
                self.kv.free(state)

    def _sync(self, request: Request) -> Request:
        """The request's shadow, its tokens replaced by the request's and its computed count cut to
        the longest common prefix of old and new tokens (draft KV beyond it is stale)."""
        state = self._states.get(request.request_id)
        if state is None:
            state = Request(request_id=request.request_id, prompt_token_ids=list(request.all_token_ids),
                            sampling_params=SamplingParams(temperature=0.0, max_tokens=None, logprobs=self.topk))
            self._states[request.request_id] = state
            return state
        old = np.asarray(state.all_token_ids[:state.num_computed_tokens], dtype=np.int64)
        new = np.asarray(request.all_token_ids[:len(old)], dtype=np.int64)
        diff = np.flatnonzero(old[:len(new)] != new)
        common = int(diff[0]) if diff.size else len(new)
        state.all_token_ids = list(request.all_token_ids)
        state.num_computed_tokens = min(common, request.num_tokens - 1)
        return state

    def propose(self, requests: list[Request]) -> dict[str, list[int] | DraftTree]:
        """k greedy draft steps over all requests at once (the first also catches up the context); with a tree,
        each request's tree from the top-k of the same steps."""
        from framework.core.outputs import SchedulerOutput

        states = [self._sync(r) for r in requests]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        ranked: dict[str, list[list[int]]] = {r.request_id: [] for r in requests}
        for _ in range(self.num_speculative_tokens):
            active = [s for s in states if s.num_tokens < self.max_len
                      and self.kv.allocate_slots(s, s.num_tokens - s.num_computed_tokens) is not None]
            if not active:
                break
            n = {s.request_id: s.num_tokens - s.num_computed_tokens for s in active}
            so = SchedulerOutput(scheduled_requests=active, num_scheduled_tokens=n,
                                 total_num_scheduled_tokens=sum(n.values()),
                                 block_ids={s.request_id: self.kv.get_block_tables(s.request_id) for s in active})
            out = self.runner.execute_scheduled(so)
            for s in active:
                s.num_computed_tokens += n[s.request_id]
                token = out.sampled_token_ids[s.request_id][0]
                s.all_token_ids.append(token)
                drafts[s.request_id].append(token)
                if self.paths is not None:  # the chain's token first, then the others by logprob
                    top = out.logprobs[s.request_id][0]
                    ranked[s.request_id].append([token] + sorted(set(top) - {token}, key=lambda t: -top[t]))
            states = active
        if self.paths is not None:
            return {rid: tree_from_ranked(self.paths, self.parents, ranked[rid]) for rid in drafts}
        return drafts


@hookimpl
def register_drafters(register: Register) -> None:
    """Register ``draft_model``."""
    register("draft_model", DraftModelDrafter)
