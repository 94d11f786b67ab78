"""``router=prefix_score``: llm-d's filter -> score -> pick, a weighted sum of a prefix-cache score and
load scores."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.router import ReplicaState, Router, live_replicas


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the prompt's full blocks (block ``i``'s hash covers blocks ``0..i``, as vLLM's
    prefix cache keys blocks), at most ``max_blocks`` of them."""
    hashes, parent = [], b""
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        block = ",".join(map(str, token_ids[start:start + block_size])).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixScoreRouter(Router):
    """llm-d's inference scheduler (its "estimated" prefix-cache scorer, from the Gateway API Inference
    Extension's endpoint picker): **filter** the alive replicas, **score** each one, **pick** the highest
    total (ties: a seeded random one among them, llm-d's max-score picker).

    Scores, each in [0, 1], summed with weights:

    * prefix: the fraction of the prompt's full blocks (``block_size`` tokens, at most ``max_prefix_blocks``)
      that the replica holds as a leading run, per an LRU index of the block hashes routed to it
      (``lru_capacity_per_replica`` blocks per replica; the index records where prompts were *sent*);
    * queue: ``(max_waiting - waiting) / (max_waiting - min_waiting)`` over the alive replicas (1 for all
      when equal);
    * kv_cache: ``1 - kv_cache_usage``.

    After picking, the prompt's blocks are recorded in the chosen replica's index.

    Args:
        prefix_weight, queue_weight, kv_cache_weight: the scorers' weights (llm-d's inference-scheduling
            profile: 3, 2, 2).
        block_size: tokens per hashed block (vLLM's default KV block size, 16).
        max_prefix_blocks: blocks of a prompt looked at (llm-d: 256).
        lru_capacity_per_replica: block hashes remembered per replica (llm-d: 31250).

    Raises:
        ValueError: a negative weight, or a size < 1.
    """

    name = "prefix_score"

    def __init__(self, seed: int = 0, prefix_weight: float = 3.0, queue_weight: float = 2.0,
                 kv_cache_weight: float = 2.0, block_size: int = 16, max_prefix_blocks: int = 256,
                 lru_capacity_per_replica: int = 31250) -> None:
        super().__init__(seed)
        weights = {"prefix_weight": prefix_weight, "queue_weight": queue_weight, "kv_cache_weight": kv_cache_weight}
        sizes = {"block_size": block_size, "max_prefix_blocks": max_prefix_blocks,
                 "lru_capacity_per_replica": lru_capacity_per_replica}
        problems = ([f"{k} must be >= 0, got {v}" for k, v in weights.items() if v < 0]
                    + [f"{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1])
        if problems:
            raise ValueError("router prefix_score: " + "; ".join(problems))
        self.prefix_weight, self.queue_weight, self.kv_cache_weight = map(float, weights.values())
        self.block_size, self.max_prefix_blocks, self.lru_capacity = block_size, max_prefix_blocks, lru_capacity_per_replica
        self._index: dict[int, OrderedDict[bytes, None]] = {}  # replica id -> block hashes, LRU order

    def prefix_score(self, hashes: Sequence[bytes], replica_id: int) -> float:
        """Leading blocks of ``hashes`` in the replica's index over ``len(hashes)``; 0 for no full block."""
        index = self._index.get(replica_id, {})
        matched = 0
        while matched < len(hashes) and hashes[matched] in index:
            matched += 1
        return matched / len(hashes) if hashes else 0.0

    def scores(self, prompt_token_ids: Sequence[int], live: Sequence[ReplicaState]) -> dict[int, float]:
        """Each alive replica's weighted total score (higher is better)."""
        hashes = block_hashes(prompt_token_ids, self.block_size, self.max_prefix_blocks)
        waiting = [r.num_waiting_reqs for r in live]
        low, high = min(waiting), max(waiting)
        return {r.replica_id: (self.prefix_weight * self.prefix_score(hashes, r.replica_id)
                               + self.queue_weight * ((high - r.num_waiting_reqs) / (high - low) if high > low else 1.0)
                               + self.kv_cache_weight * (1.0 - r.kv_cache_usage))
                for r in live}

    def route(self, request_id: str, prompt_token_ids: Sequence[int], replicas: Sequence[ReplicaState]) -> int:
        """Filter (alive), score, pick the maximum; records the prompt's blocks under the choice."""
        scores = self.scores(prompt_token_ids, live_replicas(replicas))
        best = max(scores.values())
        choice = self.rng.choice([rid for rid, s in scores.items() if s >= best - 1e-12])
        index = self._index.setdefault(choice, OrderedDict())
        for h in block_hashes(prompt_token_ids, self.block_size, self.max_prefix_blocks):
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.lru_capacity:
            index.popitem(last=False)
        return choice

    def on_replica_removed(self, replica_id: int) -> None:
        """Drop the dead replica's index."""
        self._index.pop(replica_id, None)


@hookimpl
def register_routers(register: Register) -> None:
    """Register ``prefix_score``."""
    register("prefix_score", PrefixScoreRouter)
