"""The approximate radix tree of SGLang's cache-aware router: one tree over token ids shared by every
replica ("tenant"), each node remembering which replicas it was routed to and when.

It is approximate because it records where requests were *sent*, not what each replica's KV cache holds
(a replica may have evicted a prefix the tree still credits it with); each tenant's part is capped by LRU
eviction of its leaves. Time is a logical tick (one per insert), so routing is reproducible.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence


class _Node:
    """One edge of the tree: ``key`` is its token run (non-empty except at the root)."""

    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.key = key  # tokens on the edge from the parent
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token of the child's key -> child
        self.tenants: dict[int, int] = {}  # replica id -> tick of its last insert through this node


def _common(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[start:]``."""
    n = min(len(key), len(tokens) - start)
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i


class ApproxRadixTree:
    """Routed prompts per replica; ``size(tenant)`` counts the tokens of the nodes a tenant is on."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self._tick = 0
        self._size: dict[int, int] = {}  # tenant -> tokens

    def size(self, tenant: int) -> int:
        """Tokens recorded for ``tenant`` (the sum of its nodes' key lengths)."""
        return self._size.get(tenant, 0)

    def insert(self, tokens: Sequence[int], tenant: int) -> None:
        """Record that ``tokens`` were routed to ``tenant`` (every node on the path gets the current tick)."""
        self._tick += 1
        node, i = self.root, 0
        node.tenants[tenant] = self._tick
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(tuple(tokens[i:]), node)
                node.children[tokens[i]] = child
                common = len(child.key)
            else:
                common = _common(child.key, tokens, i)
                if common < len(child.key):
                    child = self._split(child, common)
            if tenant not in child.tenants:
                self._size[tenant] = self.size(tenant) + len(child.key)
            child.tenants[tenant] = self._tick
            node, i = child, i + common

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; returns the new upper node (same tenants, sizes unchanged)."""
        parent = child.parent
        upper = _Node(child.key[:at], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def match(self, tokens: Sequence[int], allowed: Collection[int]) -> tuple[int, int | None]:
        """The longest routed prefix of ``tokens`` on any tenant in ``allowed``.

        Returns:
            ``(matched_tokens, tenant)``: the tenant is the most recently used one on the deepest matched
            node; ``(0, None)`` when nothing matches.
        """
        node, i, best = self.root, 0, None
        while i < len(tokens):
            child = node.children.get(tokens[i])
            live = [t for t in child.tenants if t in allowed] if child is not None else []
            if not live:
                break
            common = _common(child.key, tokens, i)
            i += common
            best = max(live, key=child.tenants.__getitem__)
            node = child
            if common < len(child.key):
                break
        return i, best

    def remove_tenant(self, tenant: int) -> None:
        """Forget ``tenant`` everywhere (a dead replica); nodes left with no tenant are dropped."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.tenants.pop(tenant, None)
            stack.extend(node.children.values())
        self._prune(self.root)
        self._size.pop(tenant, None)

    def _prune(self, node: _Node) -> None:
        for key, child in list(node.children.items()):
            self._prune(child)
            if not child.tenants and not child.children:
                del node.children[key]

    def evict(self, tenant: int, max_tokens: int) -> None:
        """Drop ``tenant``'s least recently used leaves until its size is at most ``max_tokens``."""
        if self.size(tenant) <= max_tokens:
            return
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:  # the tenant's leaves: nodes on the tenant none of whose children are
            node = stack.pop()
            on = [c for c in node.children.values() if tenant in c.tenants]
            if node is not self.root and not on:
                heapq.heappush(heap, (node.tenants[tenant], id(node), node))
            stack.extend(on)
        while heap and self.size(tenant) > max_tokens:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self._size[tenant] -= len(node.key)
            parent = node.parent
            if not node.tenants and not node.children:
                del parent.children[node.key[0]]
            if parent is not self.root and not any(tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
