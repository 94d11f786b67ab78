"""``router=cache_aware``: SGLang's cache-aware router (an approximate radix tree per replica, longest
prefix wins while the load is balanced)."""

from __future__ import annotations

from collections.abc import Sequence

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.router import ReplicaState, Router, live_replicas
from plugins.routers._approx_tree import ApproxRadixTree


class CacheAwareRouter(Router):
    """SGLang's ``cache_aware`` policy (sgl-router; SGLang blog "SGLang v0.4: cache-aware load balancer",
    Dec 2024), over token ids instead of text.

    Every routed prompt is inserted into an approximate radix tree (``plugins/routers/_approx_tree.py``)
    under the replica it went to. For a new request:

    1. If the load is imbalanced -- ``max_load - min_load > balance_abs_threshold`` **and**
       ``max_load > balance_rel_threshold * min_load``, load = requests in flight (waiting + running) --
       the least loaded replica wins (ties: lowest id).
    2. Else the longest routed prefix decides: when ``matched / prompt_tokens > cache_threshold`` the
       replica holding it wins; otherwise the replica with the smallest tree (most cache room; ties: lower
       load, then lowest id).

    The prompt is then inserted under the chosen replica, and that replica's part of the tree is cut back
    to ``max_tree_size`` tokens (LRU leaves first). A dead replica's part is dropped.

    Args:
        cache_threshold: minimum matched fraction of the prompt for cache affinity (SGLang: 0.3).
        balance_abs_threshold: load difference, requests, past which the load decides (SGLang: 64).
        balance_rel_threshold: load ratio past which the load decides (SGLang: 1.5).
        max_tree_size: tokens kept per replica (SGLang: 2**26).

    Raises:
        ValueError: a parameter out of range.
    """

    name = "cache_aware"

    def __init__(self, seed: int = 0, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 26) -> None:
        super().__init__(seed)
        problems = [msg for bad, msg in (
            (not 0.0 <= cache_threshold <= 1.0, f"cache_threshold must be in [0, 1], got {cache_threshold}"),
            (balance_abs_threshold < 0, f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}"),
            (balance_rel_threshold < 1.0, f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}"),
            (max_tree_size < 1, f"max_tree_size must be >= 1 token, got {max_tree_size}")) if bad]
        if problems:
            raise ValueError("router cache_aware: " + "; ".join(problems))
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = int(max_tree_size)
        self.tree = ApproxRadixTree()

    def is_imbalanced(self, live: Sequence[ReplicaState]) -> bool:
        """SGLang's test: both the absolute and the relative load thresholds are passed."""
        loads = [r.load for r in live]
        return (max(loads) - min(loads) > self.balance_abs_threshold
                and max(loads) > self.balance_rel_threshold * min(loads))

    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """See the class docstring; records the prompt under the chosen replica."""
        live = live_replicas(replicas)
        if self.is_imbalanced(live):
            choice = min(live, key=lambda r: (r.load, r.replica_id)).replica_id
        else:
            matched, holder = self.tree.match(prompt_token_ids, {r.replica_id for r in live})
            if holder is not None and matched / max(len(prompt_token_ids), 1) > self.cache_threshold:
                choice = holder
            else:
                choice = min(live, key=lambda r: (self.tree.size(r.replica_id), r.load, r.replica_id)).replica_id
        self.tree.insert(prompt_token_ids, choice)
        self.tree.evict(choice, self.max_tree_size)
        return choice

    def on_replica_removed(self, replica_id: int) -> None:
        """Drop the dead replica's prefixes from the tree."""
        self.tree.remove_tenant(replica_id)


@hookimpl
def register_routers(register: Register) -> None:
    """Register ``cache_aware``."""
    register("cache_aware", CacheAwareRouter)
