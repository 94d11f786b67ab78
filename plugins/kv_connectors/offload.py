"""``kv_connector=offload``: a CPU memory tier and an optional disk tier under the engine's KV cache.

The engine's own paged cache is small; blocks it evicts are recomputed unless something kept them. This connector
keeps every full block a step computes (prompt and generated tokens alike, keyed by the prefix key of all tokens
up to the block's end, :func:`framework.interfaces.kv_connector.prefix_block_hashes`) in a CPU tier, spilling the
CPU tier's least recently used blocks to a disk tier, and loads them back when a later request (the next turn of a
conversation, a preempted request) needs them and the local prefix cache no longer has them (LMCache's local CPU
and disk backends, Liu et al. 2024; vLLM's ``OffloadingConnector``). It is its own producer and consumer
(``kv_transfer.role=kv_both``).

The tiers live with the worker side (:class:`~plugins.kv_connectors._tiers.TieredBlockStore`), which owns the
bytes, the LRU order and the limits; it reports each block it gains or drops (``get_kv_connector_kv_cache_events``)
and the scheduler side offers exactly the blocks reported stored. Saves copy the block out of the cache
synchronously (``wait_for_save``; the cache may be overwritten next step); disk writes then run on a background
thread. Loads from the CPU tier are synchronous, before the forward. A lookup that needs a block from the disk tier
loads asynchronously (``async_load=True``, the default; vLLM's ``WAITING_FOR_REMOTE_KVS``): the request is parked,
its disk blocks are read on a background thread while the engine runs other requests, and the worker side copies
them into the cache on its own thread in ``get_finished`` before reporting the load done; with
``async_load=False`` disk reads are synchronous too. A disk hit moves back to the CPU tier once loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import KVConnector, KVConnectorMetadata, KVConnectorOutput, KVConnectorRole
from framework.interfaces.kv_connector import prefix_block_hashes
from plugins.kv_connectors._tiers import TieredBlockStore

if TYPE_CHECKING:
    from framework.config import EngineConfig
    from framework.core.outputs import SchedulerOutput
    from framework.core.request import Request
    from framework.interfaces import AttentionBackend

logger = logging.getLogger(__name__)


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    """One step's block moves (plain values)."""

    loads: list[tuple[int, str, str]] = field(default_factory=list)  # (block id, key, request id): before the forward
    async_loads: list[tuple[int, str, str]] = field(default_factory=list)  # (block id, key, request id): in background
    cancels: list[str] = field(default_factory=list)  # parked requests aborted: drop their loads, touch nothing
    saves: list[tuple[int, str, str]] = field(default_factory=list)  # (block id, key, request id): after the forward


class OffloadConnector(KVConnector):
    """CPU and disk tiers keyed by block prefix key, LRU, byte-limited (docs/kv_transfer.md#offload).

    Args:
        role, block_size, kv_role: see :class:`~framework.interfaces.KVConnector` (``kv_both``: store and load).
        cpu_bytes: the CPU tier's limit, bytes (``kv_connector.params.cpu_bytes``).
        disk_path: a folder for the disk tier (``kv_connector.params.disk_path``; None or empty: no disk tier);
            each engine writes under its own fresh subfolder, removed when the engine goes away.
        disk_bytes: the disk tier's limit, bytes (``kv_connector.params.disk_bytes``).
        async_load: a lookup that needs a disk block loads asynchronously (``kv_connector.params.async_load``;
            default True); False: every load is synchronous, before the forward.

    Raises:
        ValueError: a negative limit, or ``disk_bytes`` without ``disk_path``.
    """

    name = "offload"

    def __init__(self, role: KVConnectorRole, block_size: int, kv_role: str = "kv_both", cpu_bytes: int = 1 << 30,
                 disk_path: str | None = None, disk_bytes: int = 0, async_load: bool = True, **params: Any) -> None:
        super().__init__(role, block_size, kv_role, **params)
        problems = _param_problems(cpu_bytes, disk_path, disk_bytes)
        if problems:
            raise ValueError("; ".join(problems))
        self.cpu_bytes, self.disk_path, self.disk_bytes = int(cpu_bytes), disk_path or None, int(disk_bytes)
        self.async_load = bool(async_load)
        # scheduler side
        self._stored: set[str] = set()  # keys the worker side reported stored and not removed since
        self._on_disk: set[str] = set()  # of which the worker side last reported in the disk tier
        self._recving: set[str] = set()  # parked requests whose asynchronous loads are queued or in flight
        self._cancels: list[str] = []
        self._keys: dict[str, list[str]] = {}  # request id -> prefix keys of its full blocks so far
        self._num_saved: dict[str, int] = {}  # request id -> its leading blocks already asked to save
        self._loads: list[tuple[int, str, str]] = []
        self._async_loads: list[tuple[int, str, str]] = []
        self._step_loads: dict[int, str] = {}  # block id -> request id, of the last step's loads
        # worker side
        self.store: TieredBlockStore | None = None
        self._kv_caches: list[torch.Tensor] = []
        self._backend: AttentionBackend | None = None
        self._pending: dict[str, list[torch.Tensor | None]] = {}
        self._load_errors: set[int] = set()
        self._failed_req_ids: set[str] = set()  # requests with a load error this step: their saves are skipped
        self._reading: dict[str, list[tuple[int, str, Any]]] = {}  # request id -> (block, key, block or Future)

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Also: limits >= 0 bytes and ``disk_bytes`` only with ``disk_path``."""
        params = config.kv_connector_params
        return super().validate(config) + _param_problems(params.get("cpu_bytes", 1 << 30), params.get("disk_path"),
                                                          params.get("disk_bytes", 0))

    def _request_keys(self, request: Request) -> list[str]:
        """Prefix keys of the request's full blocks (prompt and output tokens; salted with its LoRA adapter's name),
        extended as its tokens grow."""
        keys = self._keys.get(request.request_id, [])
        tokens = request.all_token_ids
        if len(tokens) // self.block_size > len(keys):
            salt = request.lora_request.lora_name if request.lora_request is not None else ""
            keys = prefix_block_hashes(tokens, self.block_size, salt, known=keys)
            self._keys[request.request_id] = keys
        return keys

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Consecutive stored blocks from block ``num_computed_tokens / block_size`` on, in tokens, never the block
        of the request's last token."""
        if not self.is_consumer:
            return 0, False
        keys = self._request_keys(request)[:(request.num_tokens - 1) // self.block_size]
        first = end = num_computed_tokens // self.block_size
        while end < len(keys) and keys[end] in self._stored:
            end += 1
        load_async = self.async_load and any(key in self._on_disk for key in keys[first:end])
        return (end - first) * self.block_size, load_async

    def _queue_loads(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the loads of the ``num_external_tokens / block_size`` blocks after the local hit, asynchronous when
        one of them is on disk (the same rule as :meth:`get_num_new_matched_tokens`)."""
        first = request.num_computed_tokens // self.block_size
        keys = self._request_keys(request)
        loads = [(block_ids[i], keys[i], request.request_id)
                 for i in range(first, first + num_external_tokens // self.block_size)]
        if self.async_load and any(key in self._on_disk for _, key, _ in loads):
            self._async_loads += loads
            self._recving.add(request.request_id)
        else:
            self._loads += loads

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the loads of the ``num_external_tokens / block_size`` blocks after the local hit (asynchronous when
        one of them is on disk and ``async_load``)."""
        if num_external_tokens:
            self._queue_loads(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        """This step's loads, and (producer) the saves of every full block this step completes that the tiers
        do not hold (draft tokens of speculative decoding are not counted: their K/V may be rejected)."""
        meta = OffloadMetadata(loads=self._loads, async_loads=self._async_loads, cancels=self._cancels)
        self._step_loads = {block_id: rid for block_id, _, rid in self._loads}
        self._loads, self._async_loads, self._cancels = [], [], []
        if not self.is_producer:
            return meta
        for request in scheduler_output.scheduled_requests:
            rid = request.request_id
            num_spec = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            done = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[rid] - num_spec
            num_full = min(done, request.num_tokens) // self.block_size
            start = self._num_saved.get(rid, 0)
            if num_full > start:
                keys, table = self._request_keys(request), scheduler_output.block_ids[rid][0]
                meta.saves += [(table[i], keys[i], rid) for i in range(start, num_full) if keys[i] not in self._stored]
                self._num_saved[rid] = num_full
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the worker side's store events (``("stored", key)`` / ``("removed", key)``); a request whose load
        failed saves its blocks again (the worker skipped them: they were computed over the missing K/V)."""
        for block_id in connector_output.invalid_block_ids:
            if block_id in self._step_loads:
                self._num_saved.pop(self._step_loads[block_id], None)
        self._recving -= connector_output.finished_recving or set()
        for kind, key in connector_output.kv_cache_events or ():
            if kind == "stored":
                self._stored.add(key)
            elif kind == "disk":
                self._on_disk.add(key)
            elif kind == "cpu":
                self._on_disk.discard(key)
            else:
                self._stored.discard(key)
                self._on_disk.discard(key)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (finished or aborted, waiting, parked or running); its blocks are free at once: the
        saves copied them out synchronously, and a parked request's loads are cancelled (the worker side drops them
        at the start of the next step, before it could copy them)."""
        self._keys.pop(request.request_id, None)
        self._num_saved.pop(request.request_id, None)
        if request.request_id in self._recving:
            self._recving.discard(request.request_id)
            self._async_loads = [load for load in self._async_loads if load[2] != request.request_id]
            self._cancels.append(request.request_id)
        return False, None

    # ---- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        """Keep the caches and build the tiers for blocks of this layout (``backend.get_kv_cache_shape(1)``); under
        tensor and pipeline parallelism each rank's tiers get its share of ``cpu_bytes`` and ``disk_bytes``
        (``KVShard.share_bytes``: ``1 / tensor_parallel_size`` of its stage's part of the layers, as its shard of a
        block is that share of the block's bytes), so every rank keeps and drops the same keys."""
        self._kv_caches, self._backend = list(kv_caches), backend
        shape = tuple(backend.get_kv_cache_shape(1))
        share = self.kv_shard.share_bytes  # the limits are the engine's: each rank's tiers hold its shard of every block
        self.store = TieredBlockStore(share(self.cpu_bytes), self.disk_path, share(self.disk_bytes),
                                      [(shape, t.dtype) for t in kv_caches])

    def start_load_kv(self, **kwargs: Any) -> None:
        """Drop the loads of cancelled requests; start the asynchronous loads (disk reads on the background thread,
        :meth:`get_finished` copies them); copy every synchronous load from its tier into the cache, then move the
        disk hits to the CPU tier; a block missing or unreadable is reported by
        :meth:`get_block_ids_with_load_errors`."""
        meta = self.connector_metadata()
        for rid in meta.cancels:
            self._reading.pop(rid, None)
        for block_id, key, rid in meta.async_loads:
            found = self.store.locate(key)
            where = None if found is None else found[0]
            self._reading.setdefault(rid, []).append(
                (block_id, key, self.store.read_async(*where) if isinstance(where, tuple) else where))
        promote = []
        for block_id, key, rid in meta.loads:
            found = self._fetch(block_id, key, self.store.get, key)
            if found is None:
                self._failed_req_ids.add(rid)
                continue
            block, from_disk = found
            self._backend.copy_blocks(block, [0], self._kv_caches, [block_id])
            if from_disk:
                promote.append((key, block))
        for key, block in promote:  # after every load of the step: a promotion's evictions cannot hurt them
            self.store.put(key, block)

    def _fetch(self, block_id: int, key: Any, fetch: Callable[..., Any], *args: Any) -> Any:
        """``fetch(*args)`` (a tier's block, or None when neither tier has it), or None after logging the failure
        and recording ``block_id`` as a load error of this step (a missing block, or an ``OSError``/``ValueError``
        of an unreadable one)."""
        try:
            found = fetch(*args)
        except (OSError, ValueError) as exc:
            found, error = None, exc
        else:
            error = "not in either tier"
        if found is None:
            logger.warning("kv_connector=offload: block %s (%s) failed to load: %s", block_id, key, error)
            self._load_errors.add(block_id)
        return found

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loaded every layer of the synchronous loads."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The parked requests whose every block is read: their blocks are copied into the cache here (the
        worker's own thread, between steps: nothing else uses them) and the disk hits move to the CPU tier; a block
        missing or unreadable is a load error of this step. No sends are asynchronous."""
        done = [rid for rid, reads in self._reading.items()
                if all(not isinstance(r, Future) or r.done() for _, _, r in reads)]
        for rid in done:
            for block_id, key, read in self._reading.pop(rid):
                block = self._fetch(block_id, key, _read_result, read)
                if block is None:
                    continue
                self._backend.copy_blocks(block, [0], self._kv_caches, [block_id])
                if isinstance(read, Future) or key in self.store.disk:
                    self.store.put(key, block)
        return None, set(done) or None

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Copy this layer's part of every block to save into a CPU buffer (skipping the requests whose load failed
        this step: their K/V was computed over the missing blocks)."""
        for block_id, key, rid in self.connector_metadata().saves:
            if rid in self._failed_req_ids:
                continue
            layers = self._pending.setdefault(key, [None] * len(self._kv_caches))
            layers[layer_idx] = torch.empty(self._backend.get_kv_cache_shape(1), dtype=kv_layer.dtype)
            self._backend.copy_blocks([kv_layer], [block_id], [layers[layer_idx]], [0])

    def wait_for_save(self) -> None:
        """Put each copied block into the tiers (the copies are done; disk writes go on in the background)."""
        pending, self._pending = self._pending, {}
        for key, layers in pending.items():
            if all(t is not None for t in layers):
                self.store.put(key, layers)

    def get_kv_connector_kv_cache_events(self) -> list[tuple[str, str]] | None:
        """The tiers' ``("stored", key)`` / ``("removed", key)`` events since the last step."""
        return self.store.take_events() if self.store is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed to load in this step (then forgotten)."""
        errors, self._load_errors, self._failed_req_ids = self._load_errors, set(), set()
        return errors


def _read_result(read: Any) -> Any:
    """An asynchronous read's block (``Future.result()``: raises what the read raised), or ``read`` itself when
    it was served from memory."""
    return read.result() if isinstance(read, Future) else read


def _param_problems(cpu_bytes: Any, disk_path: Any, disk_bytes: Any) -> list[str]:
    """What is wrong with the tier parameters, each naming the fix."""
    problems = []
    for name, value in (("cpu_bytes", cpu_bytes), ("disk_bytes", disk_bytes)):
        if not isinstance(value, int) or value < 0:
            problems.append(f"kv_connector.params.{name} must be a number of bytes >= 0, got {value!r}")
    if disk_bytes and not disk_path:
        problems.append("kv_connector.params.disk_bytes needs kv_connector.params.disk_path=<folder> (or set "
                        "disk_bytes=0: no disk tier)")
    return problems


@hookimpl
def register_kv_connectors(register: Register) -> None:
    """Register ``offload``."""
    register("offload", OffloadConnector)
