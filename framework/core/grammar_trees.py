"""Grammar masks per token-tree node (structured output with tree speculative decoding, ``framework/core/spec_tree.py``).

A constrained request's draft tree is verified like an unconstrained one: verify row 0 (the root's) is masked with the
grammar state after the request's output, and row ``i + 1`` (node ``i``'s) with the state after the output plus node
``i``'s root-to-node path. Each node's state is reached by advancing the request's matcher along the path and rolling
it back (``GrammarMatcher.accept_token`` / ``rollback``), so the matcher ends where it started. Nodes whose path the
grammar refuses are dropped when the drafts are set (:func:`valid_tree_nodes`), as a chain is cut to its valid prefix.
"""

from __future__ import annotations

import torch

from framework.interfaces import GrammarMatcher


def _paths(token_ids: list[int], parents: list[int]) -> list[list[int]]:
    """Per node, its root-to-node tokens (``parents`` listed parents first, ``-1``: the root)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [token_ids[node]])
    return paths


def valid_tree_nodes(matcher: GrammarMatcher, token_ids: list[int], parents: list[int]) -> list[int]:
    """The nodes whose whole root-to-node path the grammar accepts from the matcher's state (parents first; a node
    whose parent is invalid is invalid too). Does not advance the matcher."""
    return [node for node, path in enumerate(_paths(token_ids, parents))
            if matcher.validate_tokens(path) == len(path)]


def fill_tree_bitmask(matcher: GrammarMatcher, bitmask: torch.Tensor, first_row: int, token_ids: list[int],
                      parents: list[int]) -> list[int]:
    """Fill row ``first_row`` of ``bitmask`` with the matcher's current mask and row ``first_row + 1 + i`` with the
    mask after node ``i``'s path, for every node whose path the grammar accepts; the others' rows are left as they
    are (their tokens are masked in their parents' rows, so they are never accepted).

    Args:
        matcher: the request's matcher; left in its starting state.
        bitmask: ``(num_rows, ceil(vocab / 32))`` int32 CPU, written in place.
        first_row: the request's row 0.
        token_ids, parents: the scheduled tree (``parents[i] < i``, ``-1``: the root).

    Returns:
        The filled rows' offsets from ``first_row`` (0 and ``1 + i`` per valid node), ascending.
    """
    matcher.fill_bitmask(bitmask, first_row)
    filled = [0]
    for node, path in enumerate(_paths(token_ids, parents)):
        accepted = 0
        try:
            for token in path:
                if not matcher.accept_token(token):
                    break
                accepted += 1
            if accepted == len(path):
                matcher.fill_bitmask(bitmask, first_row + 1 + node)
                filled.append(1 + node)
        finally:
            if accepted:
                matcher.rollback(accepted)
    return filled
