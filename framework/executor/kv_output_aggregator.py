"""One :class:`KVConnectorOutput` for the scheduler from every rank's (vLLM V1's ``KVOutputAggregator``,
``vllm/distributed/kv_transfer/kv_connector/utils.py``).

Each rank's worker side moves only its own shard of every block (``KVConnector.kv_shard``: its KV heads of its
pipeline stage's layers) and reports its own finished transfers; the scheduler may free or publish a request's blocks only once every rank is done with them.
So an executor with more than one rank (``mp``, ``ray``) collects every rank's report each step and merges them here:

- ``finished_sending`` / ``finished_recving``: a request is reported once **every** rank has reported it, in this
  step or an earlier one (a countdown per request from the number of ranks, as vLLM's aggregator keeps).
- ``invalid_block_ids``: the union (a block is bad when any rank's shard of it failed to load).
- ``load_error_reasons``: the union, the lowest rank's reason of a block winning.
- ``kv_cache_events``: an event reaches the scheduler side once every rank has reported it (counted like a
  multiset, so a key stored, removed and stored again is counted each time; vLLM's ``KVEventAggregator`` keeps the
  events common to all workers), in the order of the rank whose report completed it.
- ``kv_connector_stats``: every rank's transfers, concatenated (bytes are per shard, so their sum is the bytes moved).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from framework.core.outputs import KVConnectorOutput, merge_load_error_reasons

if TYPE_CHECKING:
    from framework.core.outputs import ModelRunnerOutput


class KVOutputAggregator:
    """Merges the ranks' worker-side reports of each step into the one the scheduler side reads.

    Args:
        world_size: the ranks that each run a worker side (``tensor_parallel_size x pipeline_parallel_size``: a
            pipeline stage's worker side moves its own layers' part of every block), >= 1.

    Raises:
        ValueError: ``world_size < 1``.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"KVOutputAggregator needs world_size >= 1, got {world_size}")
        self.world_size = world_size
        self._sending: Counter[str] = Counter()  # request id -> ranks that reported its send done so far
        self._recving: Counter[str] = Counter()  # request id -> ranks that reported its load done so far
        self._events: Counter = Counter()  # event -> ranks that reported it and are not yet matched

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's merged report.

        Args:
            outputs: one report per rank, rank order (``None``: that rank has no connector; all ``None`` -> ``None``).

        Returns:
            The merged report (rules in the module docstring); ``finished_*`` are ``None`` when no request finished.

        Raises:
            ValueError: ``len(outputs) != world_size``, or some ranks report and others do not.
        """
        if len(outputs) != self.world_size:
            raise ValueError(f"expected {self.world_size} KV connector reports (one per rank), got {len(outputs)}")
        present = [o for o in outputs if o is not None]
        if not present:
            return None
        if len(present) != len(outputs):
            raise ValueError("some ranks have a KV connector and others do not: every rank must build its worker side")
        return KVConnectorOutput(
            finished_sending=self._count_down(self._sending, [o.finished_sending for o in present]),
            finished_recving=self._count_down(self._recving, [o.finished_recving for o in present]),
            invalid_block_ids=set().union(*(o.invalid_block_ids for o in present)),
            load_error_reasons=merge_load_error_reasons([o.load_error_reasons for o in present]),
            kv_cache_events=self._common_events([o.kv_cache_events for o in present]),
            kv_connector_stats=[s for o in present for s in o.kv_connector_stats or ()] or None)

    def merge_into(self, replies: list[ModelRunnerOutput | None], driver_rank: int) -> ModelRunnerOutput:
        """The driver rank's reply to ``execute_model``, its ``kv_connector_output`` replaced by every rank's merged.

        Args:
            replies: every rank's reply, rank order (a non-driver rank answers only its ``kv_connector_output``).
            driver_rank: the rank that sampled.
        """
        out = replies[driver_rank]
        out.kv_connector_output = self.aggregate([r.kv_connector_output if r is not None else None for r in replies])
        return out

    def _count_down(self, counts: Counter[str], reports: list[set[str] | None]) -> set[str] | None:
        """Requests that every rank has now reported (forgotten once returned)."""
        done = set()
        for report in reports:
            for request_id in report or ():
                counts[request_id] += 1
                if counts[request_id] == self.world_size:
                    del counts[request_id]
                    done.add(request_id)
        return done or None

    def _common_events(self, reports: list[list | None]) -> list | None:
        """Events that every rank has now reported, each as many times as every rank did."""
        if self.world_size == 1:
            return reports[0]
        common = []
        for report in reports:
            for event in report or ():
                key = _hashable(event)
                self._events[key] += 1
                if self._events[key] == self.world_size:
                    del self._events[key]
                    common.append(event)
        return common or None


def _hashable(event: object) -> object:
    """``event`` as a dictionary key (lists, as events decoded from a pipe may be, become tuples)."""
    return tuple(_hashable(e) for e in event) if isinstance(event, (list, tuple)) else event
