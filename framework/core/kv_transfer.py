"""The scheduler's side of a KV connector (``kv_connector=<name>``; docs/kv_transfer.md).

The :class:`~framework.core.scheduler.Scheduler` calls :class:`KVTransfer` at four points, as vLLM V1's scheduler
calls its connector: at admission (:meth:`KVTransfer.num_external_tokens`, then :meth:`KVTransfer.on_admitted`),
at the end of ``schedule()`` (:meth:`KVTransfer.build_meta`), at the start of ``update_from_output``
(:meth:`KVTransfer.load_failures`: blocks the workers could not load) and when a request finishes
(:meth:`KVTransfer.request_finished`). Loads are synchronous in this slice: the worker side loads a step's blocks
before its forward, so blocks loaded at admission are as good as computed by that step, and the KV allocator
publishes them to the prefix cache like the step's computed blocks. A block whose load failed is dropped from the
prefix cache (with every later block of the request: their K/V was computed over it), and the request either
recomputes from that block (``kv_transfer.load_failure_policy=recompute``) or fails alone (``fail``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from framework.core.request import Request
from framework.interfaces.kv_connector import KVConnector


@dataclass
class LoadFailure:
    """A request whose externally loaded K/V is partly missing after a step."""

    first_bad_token: int  # the first token of its first block that failed to load (a multiple of block_size)
    num_bad_blocks: int  # its blocks that failed to load


class KVTransfer:
    """Drives the scheduler side of ``connector`` and keeps vLLM's external prefix-cache counters.

    Args:
        connector: the scheduler-side connector instance (role ``SCHEDULER``).
        load_failure_policy: ``recompute`` or ``fail`` (``kv_transfer.load_failure_policy``).

    Attributes:
        external_prefix_cache_queries: tokens of the requests admitted while asking the connector (once per
            admission; vLLM's ``external_prefix_cache_queries``), tokens.
        external_prefix_cache_hits: of which the connector supplied (vLLM's ``external_prefix_cache_hits``), tokens.
    """

    def __init__(self, connector: KVConnector, load_failure_policy: str = "recompute") -> None:
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"load_failure_policy must be recompute or fail, got {load_failure_policy!r}")
        self.connector = connector
        self.block_size = connector.block_size
        self.load_failure_policy = load_failure_policy
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> int:
        """Tokens after the local prefix hit that the connector will load (no side effects), capped so that the
        request's last token is computed here (its logits are sampled).

        Raises:
            RuntimeError: the connector asks for an asynchronous load or answers None (not built yet).
        """
        num_tokens, load_async = self.connector.get_num_new_matched_tokens(request, num_local_tokens)
        if num_tokens is None or load_async:
            raise RuntimeError(f"kv_connector {self.connector.name!r} asked for an asynchronous load "
                               "(WAITING_FOR_REMOTE_KVS), which servelab does not run yet; answer (n, False)")
        return max(0, min(num_tokens, request.num_tokens - 1 - num_local_tokens))

    def on_admitted(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Count the lookup and let the connector queue the loads (``request.num_computed_tokens`` counts the local
        prefix hit, not yet the external tokens)."""
        self.external_prefix_cache_queries += request.num_tokens
        self.external_prefix_cache_hits += num_external_tokens
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's connector metadata, for the workers."""
        return self.connector.build_connector_meta(scheduler_output)

    def load_failures(self, scheduler_output: SchedulerOutput,
                      output: KVConnectorOutput | None) -> dict[str, LoadFailure]:
        """Hand the workers' report to the connector; the scheduled requests whose cached K/V (tokens before their
        ``num_computed_tokens`` at schedule time) includes a block that failed to load, by request id."""
        if output is None:
            return {}
        self.connector.update_connector_output(output)
        if not output.invalid_block_ids:
            return {}
        failures = {}
        for request in scheduler_output.scheduled_requests:
            table = scheduler_output.block_ids[request.request_id][0]
            cached = table[:-(-request.num_computed_tokens // self.block_size)]
            bad = [i for i, block in enumerate(cached) if block in output.invalid_block_ids]
            if bad:
                failures[request.request_id] = LoadFailure(bad[0] * self.block_size, len(bad))
        return failures

    def failure_message(self, failure: LoadFailure) -> str:
        """Why a request failed under ``load_failure_policy=fail`` (``RequestOutput.error``)."""
        return (f"kv_connector {self.connector.name!r}: the K/V of {failure.num_bad_blocks} block(s) from token "
                f"{failure.first_bad_token} on failed to load (kv_transfer.load_failure_policy=fail; recompute "
                "would compute them here instead)")

    def request_finished(self, request: Request, block_ids: list[int]) -> dict[str, Any] | None:
        """Tell the connector that ``request`` finished, before its blocks are freed; returns its
        ``kv_transfer_params``.

        Raises:
            RuntimeError: the connector asks to keep the blocks (an asynchronous send: not built yet).
        """
        delay_free, params = self.connector.request_finished(request, block_ids)
        if delay_free:
            raise RuntimeError(f"kv_connector {self.connector.name!r} asked to free request {request.request_id}'s "
                               "blocks later (an asynchronous send), which servelab does not run yet")
        return params
