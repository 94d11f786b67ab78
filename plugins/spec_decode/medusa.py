"""Medusa drafter: K heads on the target's last hidden state propose a static token tree per request.

Medusa-1 (Cai et al., ICML 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): head ``k`` guesses the token ``k + 2`` positions ahead from the hidden state whose LM-head row produced the
request's last token (the heads are in :mod:`plugins.spec_decode._medusa_heads`). Its top-k guesses per head are
expanded into a static tree of *choice paths* (Sec. 2.1.2, ``spec_decode.params.tree=[[0],[1],[0,0],...]``: path
``[a, b]`` is the ``a``-th guess of head 0 followed by the ``b``-th guess of head 1), verified in one target forward
with tree attention (``framework/core/spec_tree.py``). Without ``tree`` the drafter proposes the chain of each
head's top guess for the first ``num_speculative_tokens`` heads.

The model runner keeps the target's last hidden states of every forward (``Drafter.needs_hidden_states``); after a
tree is verified it has moved the accepted path's rows into place, so the row of position ``num_computed_tokens - 1``
is the one to draft from. No KV cache and no per-request state outlive a step.
"""

from __future__ import annotations

from typing import Any

import torch

from framework import hookimpl
from framework.config import EngineConfig
from framework.core.outputs import TargetHiddenStates
from framework.core.request import Request
from framework.core.spec_tree import DraftTree, parse_tree_paths, paths_parents, tree_from_ranked
from framework.hookspecs import Register
from framework.interfaces import Drafter

MISSING_MODEL = ("spec_decode=medusa needs spec_decode.params.model=PATH of Medusa heads (e.g. "
                 "models/stories260K-medusa; train some with python -m experiments.quality.train_medusa)")


class MedusaDrafter(Drafter):
    """``spec_decode=medusa spec_decode.params.model=PATH [spec_decode.params.tree=[[0],[1],[0,0]]]``.

    Args:
        num_speculative_tokens: without ``tree``, the chain's length (heads used, at most ``medusa_num_heads``).
        model: folder of Medusa heads in the public layout (``config.json`` + ``medusa_lm_head.safetensors``/``.pt``).
        tree: static Medusa choice paths (each a list of top-k ranks, one per depth; every prefix listed too), or
            ``None`` for the top-1 chain.

    Raises:
        ValueError: no model, or a malformed ``tree`` (also reported by :meth:`validate` before weights load).
    """

    name = "medusa"
    needs_hidden_states = True
    drafts_trees = True

    def __init__(self, num_speculative_tokens: int = 4, model: str | None = None, tree: Any = None,
                 **params: Any) -> None:
        super().__init__(num_speculative_tokens, **params)
        if not model:
            raise ValueError(MISSING_MODEL)
        self.model_path = model
        paths = parse_tree_paths(tree) if tree is not None else None
        self.paths = paths
        self._features: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, rows) of this step

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Heads readable; their hidden size and vocabulary are the target's; the tree is well formed and no deeper
        than the heads."""
        problems = super().validate(config)
        path = config.drafter_params.get("model")
        if not path:
            return problems + [MISSING_MODEL]
        from framework.model_executor.model_loader import load_model_config
        from plugins.spec_decode._medusa_heads import load_medusa_config

        try:
            heads = load_medusa_config(path)
            target = load_model_config(config.model)
        except (OSError, ValueError) as exc:
            return problems + [f"spec_decode=medusa: cannot read the Medusa heads {path!r} ({exc})"]
        problems += _mismatches(heads, target, path)
        tree = config.drafter_params.get("tree")
        if tree is not None:
            try:
                depth = max(len(p) for p in parse_tree_paths(tree))
            except ValueError as exc:
                return problems + [str(exc)]
            if depth > heads.num_heads:
                problems.append(f"spec_decode.params.tree is {depth} deep but {path!r} has {heads.num_heads} Medusa "
                                f"heads; use paths of at most {heads.num_heads} ranks")
        return problems

    def load(self, model: torch.nn.Module, model_config: Any, config: EngineConfig) -> None:
        """Load the heads in the engine's dtype and device.

        Raises:
            ValueError: the heads' hidden size or vocabulary differs from the target's, or the tree is deeper than
                the heads.
        """
        from plugins.spec_decode._medusa_heads import load_medusa_heads

        self.heads = load_medusa_heads(self.model_path, getattr(torch, config.dtype), torch.device(config.device))
        problems = _mismatches(self.heads.config, model_config, self.model_path)
        if problems:
            raise ValueError("; ".join(problems))
        if self.paths is None:  # the top-1 chain over the first k heads
            self.paths = [[0] * d for d in range(1, min(self.num_speculative_tokens, self.heads.config.num_heads) + 1)]
        if max(len(p) for p in self.paths) > self.heads.config.num_heads:
            raise ValueError(f"spec_decode.params.tree is deeper than the {self.heads.config.num_heads} Medusa heads")
        self.parents = paths_parents(self.paths)
        self.depth = max(len(p) for p in self.paths)
        self.topk = max(max(p) for p in self.paths) + 1

    def observe_hidden_states(self, hidden_states: TargetHiddenStates) -> None:
        """Keep this step's rows of each request (views; :meth:`propose` reads them in the same step)."""
        qsl, ctx = hidden_states.query_start_loc.tolist(), hidden_states.context_lens.tolist()
        self._features = {rid: (ctx[i], hidden_states.hidden_states[qsl[i]:qsl[i + 1]])
                          for i, rid in enumerate(hidden_states.request_ids)}

    def on_requests_freed(self, request_ids: Any) -> None:
        """Drop the rows of finished, aborted or preempted requests."""
        for rid in request_ids:
            self._features.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request]) -> dict[str, list[int] | DraftTree]:
        """One batched pass of every head over the requests' last features, each head's top-k, then the static
        tree per request (a request whose feature this step did not compute gets no draft)."""
        rows, ids = [], []
        for request in requests:
            first, feats = self._features.get(request.request_id, (0, None))
            at = request.num_computed_tokens - 1 - first  # the row that produced the request's last token
            if feats is not None and 0 <= at < feats.shape[0]:
                rows.append(feats[at])
                ids.append(request.request_id)
        self._features = {}
        if not rows:
            return {}
        logits = self.heads(torch.stack(rows))[:self.depth]  # (depth, R, vocab)
        probs, tokens = logits.float().softmax(-1).topk(self.topk, dim=-1)  # (depth, R, topk)
        tokens, probs = tokens.transpose(0, 1).tolist(), probs.transpose(0, 1).tolist()  # (R, depth, topk)
        return {rid: tree_from_ranked(self.paths, self.parents, tokens[r], probs[r]) for r, rid in enumerate(ids)}


def _mismatches(heads: Any, target: Any, path: str) -> list[str]:
    """Reasons the Medusa heads cannot draft for the target (hidden size, vocabulary)."""
    problems = []
    if heads.hidden_size != target.hidden_size:
        problems.append(f"spec_decode=medusa: the heads {path!r} have hidden_size {heads.hidden_size} but the target "
                        f"has {target.hidden_size}; use heads trained for this target "
                        "(python -m experiments.quality.train_medusa --model <target>)")
    if heads.vocab_size != target.vocab_size:
        problems.append(f"spec_decode=medusa: the heads {path!r} were made for vocabulary {heads.vocab_size}, the "
                        f"target has {target.vocab_size}; the heads must share the target's tokenizer")
    return problems


@hookimpl
def register_drafters(register: Register) -> None:
    """Register ``medusa``."""
    register("medusa", MedusaDrafter)
