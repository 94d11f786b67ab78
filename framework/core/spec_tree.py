"""Token trees, the unit of speculation (Medusa, Cai et al. 2024, Sec. 2.3; SpecInfer, Miao et al. 2023, Sec. 3).

A drafter may propose, per request, a tree of draft tokens instead of a chain: node ``i`` holds a token and the index
of its parent (``-1``: the root, the request's last real token, whose K/V is computed in the same verify step). Nodes
are listed parents first (``parents[i] < i``), so every prefix of the node list is itself a tree, and a chain of k
tokens is the tree ``parents = [-1, 0, 1, ..., k - 2]``. The verify step lays the nodes out after the root in the
flattened batch, at consecutive KV slots (node ``i`` at the root's slot + 1 + i), with RoPE positions by depth (the
root's position + depth) and tree attention: each node sees the context and its own ancestors only.

Static tree shapes are Medusa's *choice paths* (``spec_decode.params.tree=[[0],[1],[0,0]]``): each path lists the
top-k rank taken at each depth; :func:`parse_tree_paths` checks them and orders them parents first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class DraftTree:
    """One request's draft tree (built by a drafter, read by the proposer, the scheduler and the runner).

    Raises:
        ValueError: from ``__post_init__`` when the lengths differ or a parent does not precede its node.
    """

    token_ids: list[int]  # (num_nodes,) draft token id of each node
    parents: list[int]  # (num_nodes,) parent node index, -1 = the root (the request's last real token)
    draft_probs: list[float] | None = None  # (num_nodes,) the drafter's probability of each node's token, if known

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"a draft tree needs one parent per token, got {len(self.token_ids)} tokens and "
                             f"{len(self.parents)} parents")
        bad = [i for i, p in enumerate(self.parents) if not -1 <= p < i]
        if bad:
            raise ValueError(f"draft tree node {bad[0]} has parent {self.parents[bad[0]]}; parents must precede "
                             "their nodes (-1: the root)")

    @classmethod
    def chain(cls, token_ids: list[int]) -> DraftTree:
        """The one-branch tree of a chain of drafts (``parents = [-1, 0, 1, ...]``)."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)))

    @property
    def is_chain(self) -> bool:
        """True when every node's parent is the node before it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node, 1 for the root's children (tokens)."""
        return tree_depths(self.parents).tolist()

    def main_chain(self) -> DraftTree:
        """The chain that follows each node's first child from the root (a Medusa tree's top-1 path)."""
        nodes, at = [], -1
        while (child := next((i for i, p in enumerate(self.parents) if p == at), None)) is not None:
            nodes.append(child)
            at = child
        probs = None if self.draft_probs is None else [self.draft_probs[i] for i in nodes]
        return DraftTree([self.token_ids[i] for i in nodes], list(range(-1, len(nodes) - 1)), probs)

    def pruned(self, max_depth: int, max_nodes: int) -> DraftTree:
        """The nodes of depth ``<= max_depth``, then the first ``max_nodes`` of them (still parents first)."""
        return self.kept([i for i, d in enumerate(self.depths()) if d <= max_depth][:max(max_nodes, 0)])

    def kept(self, keep: list[int]) -> DraftTree:
        """The tree of nodes ``keep`` (ascending; each node's parent kept too, or it becomes a root child)."""
        index = {old: new for new, old in enumerate(keep)}
        probs = None if self.draft_probs is None else [self.draft_probs[i] for i in keep]
        return DraftTree([self.token_ids[i] for i in keep], [index.get(self.parents[i], -1) for i in keep], probs)


def tree_depths(parents: list[int] | np.ndarray) -> np.ndarray:
    """``(num_nodes,)`` int64 depth of each node (1 for the root's children); ``parents`` listed parents first."""
    depths = np.zeros(len(parents), dtype=np.int64)
    for i, p in enumerate(parents):
        depths[i] = 1 if p < 0 else depths[p] + 1
    return depths


def ancestor_mask(parents: list[int], num_real: int = 1) -> np.ndarray:
    """Tree attention among one request's query tokens: ``(num_real + n, num_real + n)`` bool, row ``j`` True where
    query token ``j`` may see query token ``m`` (vLLM's tree-attention bias rule: causal over the ``num_real`` real
    tokens, the last of which is the root; a node sees every real token, its ancestors and itself).

    Args:
        parents: the tree's ``(n,)`` parent indices (``-1``: the root).
        num_real: real (non-draft) tokens computed in the same step, the root last (>= 1).
    """
    n = len(parents)
    mask = np.tril(np.ones((num_real + n, num_real + n), dtype=bool))
    for i, p in enumerate(parents):  # parents first: a node's row is its parent's row plus itself
        row = num_real + i
        mask[row, num_real:] = False
        if p >= 0:
            mask[row, num_real:] = mask[num_real + p, num_real:]
        mask[row, row] = True
    return mask


def parse_tree_paths(paths: object) -> list[list[int]]:
    """Check Medusa choice paths and order them parents first (by depth, then rank).

    Args:
        paths: a sequence (list, tuple, Hydra ``ListConfig``) of non-empty sequences of ranks >= 0
            (``[[0], [1], [0, 0]]``), e.g. from ``spec_decode.params.tree``.

    Returns:
        The paths sorted by (length, ranks).

    Raises:
        ValueError: not a list of rank lists, a duplicate path, or a path whose parent path is missing.
    """
    if isinstance(paths, str) or not isinstance(paths, Sequence) or not paths:
        raise ValueError(f"spec_decode.params.tree must be a non-empty list of choice paths such as "
                         f"[[0],[1],[0,0]] (tree=dynamic: spec_decode=eagle only, EAGLE-2), got {paths!r}")
    out = []
    for path in paths:
        if (isinstance(path, str) or not isinstance(path, Sequence) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ValueError(f"spec_decode.params.tree: each path is a non-empty list of top-k ranks >= 0, got {path!r}")
        out.append([int(r) for r in path])
    seen = {tuple(p) for p in out}
    if len(seen) != len(out):
        raise ValueError("spec_decode.params.tree lists a path twice")
    missing = [p for p in out if len(p) > 1 and tuple(p[:-1]) not in seen]
    if missing:
        raise ValueError(f"spec_decode.params.tree: path {missing[0]} has no parent path {missing[0][:-1]}; "
                         "list every prefix of a path too")
    return sorted(out, key=lambda p: (len(p), p))


def paths_parents(paths: list[list[int]]) -> list[int]:
    """Parent index of each path of :func:`parse_tree_paths`'s output (``-1`` for depth-1 paths)."""
    index = {tuple(p): i for i, p in enumerate(paths)}
    return [index[tuple(p[:-1])] if len(p) > 1 else -1 for p in paths]


def tree_from_ranked(paths: list[list[int]], parents: list[int], ranked: list[list[int]],
                     probs: list[list[float]] | None = None) -> DraftTree:
    """The static tree whose node ``[.., r]`` at depth ``d`` takes ``ranked[d - 1][r]``, the ``r``-th guess at that
    depth (Medusa: head ``d - 1``'s top-k; a chain drafter: its top-k at step ``d`` along the top-1 chain). Paths
    deeper than ``ranked`` (a drafter that stopped early) are left out, with their descendants.

    Args:
        paths: :func:`parse_tree_paths`'s output; parents: :func:`paths_parents` of it.
        ranked: per depth, the guesses best first (at least ``max rank + 1`` of them).
        probs: per depth, the drafter's probability of each guess (``DraftTree.draft_probs``), or None.
    """
    keep = [i for i, p in enumerate(paths) if len(p) <= len(ranked)]  # parents first: a prefix-closed subset
    index = {old: new for new, old in enumerate(keep)}
    tokens = [ranked[len(paths[i]) - 1][paths[i][-1]] for i in keep]
    node_probs = None if probs is None else [probs[len(paths[i]) - 1][paths[i][-1]] for i in keep]
    return DraftTree(tokens, [index[parents[i]] if parents[i] >= 0 else -1 for i in keep], node_probs)


def sibling_tree_paths(tree: object, drafter: str) -> list[list[int]]:
    """Static paths a chain drafter can fill from one top-1 chain: every rank but the last is 0 (the chain plus its
    top-k alternatives at each depth as leaves), ordered parents first.

    Raises:
        ValueError: malformed paths (:func:`parse_tree_paths`), or a path that branches off a non-top-1 guess
            (it would need another draft pass; use spec_decode=medusa, whose heads guess every depth at once).
    """
    paths = parse_tree_paths(tree)
    bad = [p for p in paths if any(p[:-1])]
    if bad:
        raise ValueError(f"spec_decode={drafter} with a tree drafts its top-1 chain and the top-k alternatives at each "
                         f"depth, so every rank but a path's last must be 0; {bad[0]} is not (use spec_decode=medusa "
                         "for any static tree)")
    return paths
