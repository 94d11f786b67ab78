"""The scheduler's side of a KV connector (``kv_connector=<name>``; docs/kv_transfer.md).

The :class:`~framework.core.scheduler.Scheduler` calls :class:`KVTransfer` at five points, as vLLM V1's scheduler
calls its connector: at admission (:meth:`KVTransfer.num_external_tokens`, then :meth:`KVTransfer.on_admitted`),
at the end of ``schedule()`` (:meth:`KVTransfer.build_meta`), at the start of ``update_from_output``
(:meth:`KVTransfer.update`: blocks the workers could not load, loads and sends that completed) and when a request
finishes (:meth:`KVTransfer.request_finished`).

A synchronous load is done before the step's forward, so its blocks are as good as computed by that step and the
KV allocator publishes them to the prefix cache like the step's computed blocks. An asynchronous load (the
connector answers ``load_async=True``; vLLM's ``WAITING_FOR_REMOTE_KVS``) parks the request: its blocks are
allocated at admission but dropped from the prefix cache (no other request may hit K/V that has not arrived), it is
in no queue and in no step, and once the worker side reports it in ``finished_recving`` its blocks are published
(:meth:`KVAllocator.cache_blocks`) and it goes back to the waiting queue holding them, its external tokens computed.
A finished request whose blocks the connector still reads (``request_finished`` -> ``delay_free``: an asynchronous
send, or an aborted request whose load is in flight) keeps them until the worker side reports it in
``finished_sending`` (or ``finished_recving``); its output is returned at once.

A block whose load failed is dropped from the prefix cache (with every later block of the request: their K/V was
computed over it), and the request either recomputes from that block (``kv_transfer.load_failure_policy=recompute``)
or fails alone (``fail``), its error carrying the connector's reason for the first bad block when the worker side
gave one (``KVConnectorOutput.load_error_reasons``). Sources: vLLM V1 ``Scheduler._update_waiting_for_remote_kv``,
``_update_from_kv_xfer_finished`` and ``_free_request`` (``vllm/v1/core/sched/scheduler.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.interfaces.kv_connector import KVConnector

if TYPE_CHECKING:
    from framework.interfaces import KVAllocator


@dataclass
class LoadFailure:
    """A request whose externally loaded K/V is partly missing after a step."""

    first_bad_token: int  # the first token of its first block that failed to load (a multiple of block_size)
    num_bad_blocks: int  # its blocks that failed to load
    reason: str | None = None  # why its first bad block failed, naming the fix (KVConnector.get_load_error_reasons)


@dataclass
class ParkedLoad:
    """A request in ``WAITING_FOR_REMOTE_KVS``: its blocks are allocated, its asynchronous load is in flight."""

    request: Request
    num_loaded_tokens: int  # its num_computed_tokens once the load completes (local hit + external tokens)
    failure: LoadFailure | None = None  # blocks reported bad before the load completed


class KVTransfer:
    """Drives the scheduler side of ``connector`` and keeps vLLM's external prefix-cache counters.

    Args:
        connector: the scheduler-side connector instance (role ``SCHEDULER``).
        load_failure_policy: ``recompute`` or ``fail`` (``kv_transfer.load_failure_policy``).

    Attributes:
        external_prefix_cache_queries: tokens of the requests admitted while asking the connector (once per
            admission; vLLM's ``external_prefix_cache_queries``), tokens.
        external_prefix_cache_hits: of which the connector supplied (vLLM's ``external_prefix_cache_hits``), tokens.
        parked: request id -> its asynchronous load, for requests in ``WAITING_FOR_REMOTE_KVS``.
        loaded: ids of requests whose asynchronous load completed, back in the waiting queue holding their blocks.
        held: request id -> finished request whose blocks the connector still reads (freed when it reports so).
        transfers: ``(bytes, seconds)`` of each transfer the worker side reported finished and
            :meth:`take_transfers` has not taken yet.

    Raises:
        ValueError: an unknown ``load_failure_policy``.
    """

    def __init__(self, connector: KVConnector, load_failure_policy: str = "recompute") -> None:
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"load_failure_policy must be recompute or fail, got {load_failure_policy!r}")
        self.connector = connector
        self.block_size = connector.block_size
        self.load_failure_policy = load_failure_policy
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.parked: dict[str, ParkedLoad] = {}
        self.loaded: set[str] = set()
        self.held: dict[str, Request] = {}
        self.kv: KVAllocator | None = None
        self.transfers: list[tuple[int, float]] = []

    def attach(self, kv_allocator: KVAllocator) -> None:
        """Act on the scheduler's KV allocator for transfers (hide, publish and free the blocks of asynchronous
        loads and delayed frees); called once by the :class:`~framework.core.scheduler.Scheduler`."""
        self.kv = kv_allocator

    @property
    def in_flight(self) -> bool:
        """True while a load of a parked request or a delayed free waits for the worker side's report: the engine
        runs the workers on steps with nothing scheduled, so that ``get_finished`` is polled."""
        return bool(self.parked or self.held)

    def num_external_tokens(self, request: Request, num_local_tokens: int) -> tuple[int, bool]:
        """``(tokens after the local prefix hit that the connector will load, whether asynchronously)``, no side
        effects; capped so that the request's last token is computed here (its logits are sampled)."""
        num_tokens, load_async = self.connector.get_num_new_matched_tokens(request, num_local_tokens)
        num_tokens = max(0, min(num_tokens or 0, request.num_tokens - 1 - num_local_tokens))
        return num_tokens, bool(load_async) and num_tokens > 0

    def on_admitted(self, request: Request, block_ids: list[int], num_external_tokens: int, load_async: bool) -> None:
        """Count the lookup and let the connector queue the loads (``request.num_computed_tokens`` counts the local
        prefix hit, not yet the external tokens). An asynchronous load parks the request: status
        ``WAITING_FOR_REMOTE_KVS``, its external blocks dropped from the prefix cache until they arrive."""
        if request.request_id not in self.loaded:  # a loaded request's re-admission is not a new lookup
            self.external_prefix_cache_queries += request.num_tokens
            self.external_prefix_cache_hits += num_external_tokens
        self.loaded.discard(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)
        if load_async:
            first = request.num_computed_tokens // self.block_size
            self.kv.evict_blocks(block_ids[first:first + num_external_tokens // self.block_size])
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.parked[request.request_id] = ParkedLoad(request, request.num_computed_tokens + num_external_tokens)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's connector metadata, for the workers."""
        return self.connector.build_connector_meta(scheduler_output)

    def update(self, scheduler_output: SchedulerOutput, output: KVConnectorOutput | None
               ) -> tuple[dict[str, LoadFailure], list[tuple[Request, LoadFailure | None]]]:
        """Hand the workers' report to the connector and apply its finished transfers.

        Returns:
            ``(failures, loaded)``: the scheduled requests whose cached K/V (tokens before their
            ``num_computed_tokens`` at schedule time) includes a block that failed to load, by request id; and the
            parked requests whose loads completed, each with its load failure or None: their blocks are published
            up to their new ``num_computed_tokens`` and the scheduler puts them back in the waiting queue.
        """
        if output is None:
            return {}, []
        self.connector.update_connector_output(output)
        self.transfers += output.kv_connector_stats or ()
        failures, reasons = {}, output.load_error_reasons or {}
        if output.invalid_block_ids:
            for request in scheduler_output.scheduled_requests:
                failure = self._failure(scheduler_output.block_ids[request.request_id][0],
                                        request.num_computed_tokens, output.invalid_block_ids, reasons)
                if failure is not None:
                    failures[request.request_id] = failure
            for parked in self.parked.values():
                failure = self._failure(self.kv.get_block_ids(parked.request.request_id), parked.num_loaded_tokens,
                                        output.invalid_block_ids, reasons)
                if failure is not None and (parked.failure is None or
                                            failure.first_bad_token < parked.failure.first_bad_token):
                    parked.failure = failure
        for rid in (output.finished_sending or set()) | (output.finished_recving or set()):
            if rid in self.held:  # a delayed free: the connector no longer reads its blocks
                self.kv.free(self.held.pop(rid))
        loaded = [self._load_done(self.parked.pop(rid)) for rid in output.finished_recving or () if rid in self.parked]
        return failures, loaded

    def take_transfers(self) -> list[tuple[int, float]]:
        """The finished transfers' ``(bytes, seconds)`` since the last call (for the step's metrics)."""
        transfers, self.transfers = self.transfers, []
        return transfers

    def _failure(self, table: list[int], num_cached_tokens: int, invalid: set[int], reasons: dict[int, str]
                 ) -> LoadFailure | None:
        """The load failure among the first ``num_cached_tokens`` tokens' blocks of ``table`` (with its first bad
        block's reason, if any), or None."""
        bad = [i for i, block in enumerate(table[:-(-num_cached_tokens // self.block_size)]) if block in invalid]
        return LoadFailure(bad[0] * self.block_size, len(bad), reasons.get(table[bad[0]])) if bad else None

    def _load_done(self, parked: ParkedLoad) -> tuple[Request, LoadFailure | None]:
        """A parked request's load completed: its tokens up to the first bad block (all of them without a failure)
        count as computed and their blocks are published; the blocks from the first bad one on stay out of the
        prefix cache. A request left with nothing computed gives its blocks back (its next admission looks up
        the prefix cache afresh, as vLLM does)."""
        request, failure = parked.request, parked.failure
        request.num_computed_tokens = parked.num_loaded_tokens if failure is None else failure.first_bad_token
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        if request.num_computed_tokens:
            self.kv.cache_blocks(request, request.num_computed_tokens)
            self.loaded.add(request.request_id)
        else:
            self.kv.free(request)
        return request, failure

    def rewind(self, request: Request, failure: LoadFailure) -> None:
        """Some of ``request``'s K/V failed to load: its blocks from the first bad one on (the later ones were
        computed over it) leave the prefix cache, and it is set to recompute from there (vLLM's rule); under
        ``load_failure_policy=fail`` the scheduler then fails it alone (:meth:`failure_message`)."""
        self.kv.evict_blocks(self.kv.get_block_ids(request.request_id)[failure.first_bad_token // self.kv.block_size:])
        request.num_computed_tokens = failure.first_bad_token

    def failure_message(self, failure: LoadFailure) -> str:
        """Why a request failed under ``load_failure_policy=fail`` (``RequestOutput.error``): the connector's reason
        for its first bad block when the worker side gave one (:meth:`KVConnector.get_load_error_reasons`)."""
        why = f": {failure.reason}" if failure.reason else ""
        return (f"kv_connector {self.connector.name!r}: the K/V of {failure.num_bad_blocks} block(s) from token "
                f"{failure.first_bad_token} on failed to load{why} (kv_transfer.load_failure_policy=fail; recompute "
                "would compute them here instead)")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Tell the connector that ``request`` finished (aborted while parked included), before its blocks are freed.

        Returns:
            ``(held, kv_transfer_params)``: True when the connector still reads the blocks (``delay_free``: an
            asynchronous send, or a load in flight it cannot cancel): they stay allocated until the worker side
            reports the request finished sending (or receiving), and the scheduler must not free them; False: free
            them now (for a parked request, the connector cancelled its load).
        """
        delay_free, params = self.connector.request_finished(request, block_ids)
        self.parked.pop(request.request_id, None)
        self.loaded.discard(request.request_id)
        if delay_free:
            self.held[request.request_id] = request
        return bool(delay_free), params
