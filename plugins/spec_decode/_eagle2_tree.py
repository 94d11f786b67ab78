"""EAGLE-2 dynamic draft trees (Li et al., EMNLP 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
Draft Trees", Sec. 4), grown by the EAGLE head of :mod:`plugins.spec_decode.eagle`.

Expansion (Sec. 4.2): the root's top-k next tokens form depth 1; at each further depth the ``topk`` nodes of the
newest layer with the highest *value* (the product of the head's confidences along the node's path, summed here as
log-probabilities) are expanded, each into its top-k children. Reranking (Sec. 4.3): the ``num_draft_tokens`` nodes
of highest value over the whole grown tree are kept (a node's value never exceeds its parent's, so the kept set holds
every kept node's ancestors; ties go to the shallower, earlier node). Each depth runs one head forward over the last
real pair and the expanded nodes' ancestor closure, with tree attention and depth positions (the same step layout as
the target's tree verification: ``framework/worker/input_batch.py``); the head's K/V of the real pairs is kept, the
nodes' slots are overwritten by the next catch-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from framework.core.outputs import SchedulerOutput
from framework.core.spec_tree import DraftTree


@dataclass
class _Node:
    """One grown node of a request's tree."""

    token: int  # its draft token
    parent: int  # index of its parent node, -1 = the root (the last real pair)
    value: float  # sum of the head's log-probabilities along its path
    logp: float  # the head's log-probability of its token (at its parent)
    feature: torch.Tensor  # (hidden,) the predicted feature its token is paired with (its parent's head output)


def grow_trees(drafter: Any, shadows: dict[str, Any], root_features: dict[str, torch.Tensor],
               root_hidden: dict[str, torch.Tensor]) -> dict[str, DraftTree]:
    """Grow and rerank one dynamic tree per request.

    Args:
        drafter: the :class:`~plugins.spec_decode.eagle.EagleDrafter` (its head, LM head, KV pool, runner, ``topk``,
            ``num_speculative_tokens`` as the depth, ``num_draft_tokens``).
        shadows: request id -> the head-side request, every real pair computed (``num_computed_tokens == num_tokens``).
        root_features: request id -> ``(hidden,)`` the target feature of the last real pair (recomputed each depth).
        root_hidden: request id -> ``(hidden,)`` the head's predicted feature at the last real pair.

    Returns:
        request id -> its tree (nodes parents first, ``draft_probs`` the head's probability of each node's token).
    """
    k = drafter.topk
    rids = list(shadows)
    nodes: dict[str, list[_Node]] = {rid: [] for rid in rids}
    layer: dict[str, list[int]] = {}
    logp = drafter.lm_head(torch.stack([root_hidden[r] for r in rids])).float().log_softmax(-1)
    top = logp.topk(k, dim=-1)
    for j, rid in enumerate(rids):
        for lp, tok in zip(top.values[j].tolist(), top.indices[j].tolist()):
            nodes[rid].append(_Node(tok, -1, min(lp, 0.0), min(lp, 0.0), root_hidden[rid]))
        layer[rid] = list(range(k))
    for _ in range(drafter.num_speculative_tokens - 1):
        expand = {rid: sorted(layer[rid], key=lambda i, r=rid: -nodes[r][i].value)[:k] for rid in layer}
        query = {rid: _closure(nodes[rid], expand[rid]) for rid in expand}
        rows = _tree_step(drafter, {rid: shadows[rid] for rid in expand}, nodes, query, root_features)
        if not rows:
            break
        layer = {}
        for rid, out in rows.items():  # out: (1 + len(query), hidden), row 1 + q is query[q]'s output
            position = {node: 1 + q for q, node in enumerate(query[rid])}
            hidden = out[[position[e] for e in expand[rid]]]
            child = drafter.lm_head(hidden).float().log_softmax(-1).topk(k, dim=-1)
            layer[rid] = []
            for e, lps, toks, h in zip(expand[rid], child.values.tolist(), child.indices.tolist(), hidden):
                for lp, tok in zip(lps, toks):
                    layer[rid].append(len(nodes[rid]))
                    lp = min(lp, 0.0)  # so a child's value never exceeds its parent's (rounding)
                    nodes[rid].append(_Node(tok, e, nodes[rid][e].value + lp, lp, h))
    return {rid: _rerank(nodes[rid], drafter.num_draft_tokens) for rid in rids}


def _closure(nodes: list[_Node], keep: list[int]) -> list[int]:
    """``keep`` and all their ancestors, in node order (parents first)."""
    out: set[int] = set()
    for i in keep:
        while i >= 0 and i not in out:
            out.add(i)
            i = nodes[i].parent
    return sorted(out)


def _tree_step(drafter: Any, shadows: dict[str, Any], nodes: dict[str, list[_Node]], query: dict[str, list[int]],
               root_features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One head forward per request over its last real pair (recomputed) and its ``query`` nodes, with tree attention.

    Returns:
        request id -> ``(1 + len(query), hidden)`` head outputs (the root's row first); requests whose head KV could
        not grow are left out.
    """
    from framework.model_executor.forward_context import ForwardContext, forward_context

    ready, spec, parents, feats = [], {}, {}, {}
    for rid, shadow in shadows.items():
        q = query[rid]
        shadow.num_computed_tokens = shadow.num_tokens - 1  # the root pair again: the query's real token
        if drafter.kv.allocate_slots(shadow, 1 + len(q)) is None:
            shadow.num_computed_tokens = shadow.num_tokens
            continue
        index = {node: j for j, node in enumerate(q)}
        spec[rid] = [nodes[rid][i].token for i in q]
        parents[rid] = [index.get(nodes[rid][i].parent, -1) for i in q]
        feats[rid] = torch.stack([root_features[rid]] + [nodes[rid][i].feature for i in q])
        ready.append(shadow)
    if not ready:
        return {}
    n = {s.request_id: 1 + len(spec[s.request_id]) for s in ready}
    so = SchedulerOutput(scheduled_requests=ready, num_scheduled_tokens=n, total_num_scheduled_tokens=sum(n.values()),
                         block_ids={s.request_id: drafter.kv.get_block_tables(s.request_id) for s in ready},
                         scheduled_spec_decode_tokens=spec, scheduled_spec_decode_parents=parents)
    batch = drafter.runner.prepare_inputs(so)
    features = torch.cat([feats[r.request_id] for r in batch.requests])[None]  # (1, num_tokens, hidden)
    metadata = drafter.runner.backend.build_metadata(batch.common)
    with forward_context(ForwardContext(drafter.runner.backend, metadata, drafter.runner.kv_caches)):
        out = drafter.head(batch.input_ids, batch.positions, features)[0]  # (num_tokens, hidden)
    for s in ready:
        s.num_computed_tokens = s.num_tokens  # the real pairs' K/V stays; the nodes' slots are reused
    qsl = batch.query_start_loc_cpu
    return {r.request_id: out[int(qsl[i]):int(qsl[i + 1])] for i, r in enumerate(batch.requests)}


def _rerank(nodes: list[_Node], budget: int) -> DraftTree:
    """The ``budget`` nodes of highest value (ties: earlier first), parents first, as a :class:`DraftTree`."""
    best = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].value, i))[:budget])
    index = {old: new for new, old in enumerate(best)}
    return DraftTree([nodes[i].token for i in best], [index.get(nodes[i].parent, -1) for i in best],
                     [math.exp(nodes[i].logp) for i in best])
