"""KV connector: moves KV-cache blocks between this engine's paged cache and somewhere else (vLLM V1's
``KVConnectorBase_V1``, ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

One class, two instances per engine: the **scheduler side** (built once on the driver, role
``KVConnectorRole.SCHEDULER``) decides which prompt tokens an external store can supply and tells the
workers what to move each step (a :class:`KVConnectorMetadata`); the **worker side** (built on every rank,
role ``KVConnectorRole.WORKER``) moves the bytes between the store and the rank's KV tensors around the
forward. Disaggregated prefill/decode (DistServe, Zhong et al., OSDI'24; Splitwise; Mooncake) and KV offload
tiers (LMCache) are both connectors.

Sources: vLLM V1 ``KVConnectorBase_V1`` and its ``SharedStorageConnector`` example; LMCache
(``LMCacheConnectorV1``); DistServe.
"""

from __future__ import annotations

import enum
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput
from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    import torch

    from framework.core.outputs import SchedulerOutput
    from framework.core.request import Request
    from framework.interfaces.attention import AttentionBackend

__all__ = ["KV_ROLES", "KVConnector", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole", "KVShard",
           "prefix_block_hashes"]

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")  # kv_transfer.role (vLLM's KVTransferConfig.kv_role)


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is (vLLM's ``KVConnectorRole``)."""

    SCHEDULER = 0  # on the driver, next to the scheduler
    WORKER = 1  # on each worker rank, next to the KV tensors


@dataclass(frozen=True)
class KVShard:
    """Which part of every KV block one worker side holds: under tensor parallelism rank ``tp_rank`` of ``tp_size``
    holds the K/V of its own KV heads only (vLLM: each worker's connector reads
    ``get_tensor_model_parallel_rank()`` / ``_world_size()`` and moves only its shard); under pipeline parallelism
    stage ``pp_rank`` holds the K/V of its own decoder layers only (vLLM: a stage registers only its layers' caches),
    and its worker side sees only those layers' caches, indexed from 0.

    The engine sets :attr:`KVConnector.kv_shard` right after building an instance: a worker side's own shard; the
    scheduler side gets ``tp_rank=0``, ``pp_rank=0`` with the engine's ``tp_size`` and ``stage_layers`` (its layout,
    to look every shard up).
    """

    tp_rank: int = 0  # this worker side's tensor-parallel rank, 0 <= tp_rank < tp_size
    tp_size: int = 1  # parallel.tensor_parallel_size of the engine
    pp_rank: int = 0  # this worker side's pipeline stage, 0 <= pp_rank < pp_size
    # pipeline parallelism: [start, end) of every stage's decoder layers, stage order; (): one stage holds them all
    stage_layers: tuple[tuple[int, int], ...] = ()

    @property
    def pp_size(self) -> int:
        """``parallel.pipeline_parallel_size`` of the engine (1 without stages)."""
        return max(1, len(self.stage_layers))

    @property
    def tag(self) -> str:
        """``""`` for an unsharded engine, else ``tp<rank>of<size>`` and/or ``pp<stage>of<stages>.layers<start>-<end>``
        joined by ``.``: a store keys each shard's bytes by it, so the shards of a TP=2 or PP=2 engine never mix
        with each other or with another layout's blocks (the layer range too: two PP=2 engines of other
        ``pp_layer_partition`` hold other layers under the same stage number)."""
        parts = [f"tp{self.tp_rank}of{self.tp_size}"] if self.tp_size > 1 else []
        if self.pp_size > 1:
            start, end = self.stage_layers[self.pp_rank]
            parts.append(f"pp{self.pp_rank}of{self.pp_size}.layers{start}-{end}")
        return ".".join(parts)

    def all_ranks(self) -> list[KVShard]:
        """Every shard of this layout, rank order (stage by stage, TP ranks within; a scheduler side checks that
        each rank stored a block)."""
        return [KVShard(rank, self.tp_size, stage, self.stage_layers)
                for stage in range(self.pp_size) for rank in range(self.tp_size)]

    def share_bytes(self, limit_bytes: int) -> int:
        """This shard's part of an engine-wide byte limit, rounded down: ``limit_bytes x (its stage's layers / all
        layers) / tp_size``, its part of every block's bytes, so every rank's store of ``floor(limit / block
        bytes)`` blocks holds the same number of blocks (``offload``'s tiers)."""
        if self.pp_size == 1:
            return limit_bytes // self.tp_size
        start, end = self.stage_layers[self.pp_rank]
        return limit_bytes * (end - start) // (self.stage_layers[-1][1] * self.tp_size)


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, salt: str = "",
                        known: Sequence[str] = ()) -> list[str]:
    """Content keys of the full blocks of ``token_ids``: block ``i``'s key is the SHA-256 (hex) of block
    ``i - 1``'s key and block ``i``'s tokens, so a key names a whole prefix (vLLM's prefix-cache hash chain,
    with a stable hash: keys must agree across processes and runs).

    Args:
        token_ids: the token ids, in order.
        block_size: tokens per block; a partial last block gets no key.
        salt: mixed into the first block's key (e.g. a LoRA adapter's name): equal tokens under another salt
            get other keys.
        known: the keys of the first ``len(known)`` blocks, from an earlier call on a prefix of ``token_ids``
            with the same salt: only the later blocks are hashed (a growing sequence costs its new blocks).

    Returns:
        ``len(token_ids) // block_size`` 64-character hex strings.
    """
    keys = list(known)
    parent = keys[-1] if keys else hashlib.sha256(salt.encode()).hexdigest()
    for start in range(len(keys) * block_size, len(token_ids) - block_size + 1, block_size):
        block = ",".join(map(str, token_ids[start:start + block_size]))
        parent = hashlib.sha256(f"{parent}|{block}".encode()).hexdigest()
        keys.append(parent)
    return keys


class KVConnector(Plugin, ABC):
    """Base of KV connectors (config ``kv_connector=<name>``, ``kv_connector.params.*``); vLLM V1's method
    names and meanings.

    Args:
        role: the half this instance is (scheduler side or worker side).
        block_size: tokens per KV block (``engine.block_size``).
        kv_role: ``kv_producer`` (stores KV, never loads), ``kv_consumer`` (loads, never stores) or
            ``kv_both`` (``kv_transfer.role``); each connector honours it.
        **params: ``kv_connector.params``, for the subclass.

    Raises:
        ValueError: an unknown ``kv_role``.
        TypeError: unknown keyword parameters (a subclass passes on only what it does not take).
    """

    #: the shard of every block this instance moves (set by the engine after construction; default: the whole block)
    kv_shard: KVShard = KVShard()

    def __init__(self, role: KVConnectorRole, block_size: int, kv_role: str = "kv_both", **params: Any) -> None:
        if params:
            raise TypeError(f"kv connector {self.name!r} got unknown parameters {sorted(params)}")
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer.role must be one of {', '.join(KV_ROLES)}, got {kv_role!r}")
        self.role = role
        self.block_size = block_size
        self.kv_role = kv_role
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_producer(self) -> bool:
        """True when this engine stores KV for others (``kv_producer`` or ``kv_both``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """True when this engine loads KV that others stored (``kv_consumer`` or ``kv_both``)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    # ---- scheduler side ----------------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond ``num_computed_tokens`` whose K/V the external store can supply now.

        Called by the scheduler for a waiting request before admission (possibly several times for one
        request, e.g. before a preemption decision): no side effects. The engine computes at least the last
        token of the request itself (vLLM's rule: its logits are needed), so a full-prompt hit should answer
        one block short; the scheduler caps the answer there in any case.

        Args:
            request: the waiting request (``all_token_ids``, ``sampling_params.kv_transfer_params``).
            num_computed_tokens: tokens the local prefix cache already serves (a multiple of ``block_size``).

        Returns:
            ``(num_external_tokens, load_async)``: tokens to load (0: none), and True when the load completes
            between steps (vLLM's ``WAITING_FOR_REMOTE_KVS``: the request holds its blocks, is in no step, and its
            loaded blocks serve no prefix hit until the worker side reports it in ``get_finished``'s ``recving``),
            False for loads done before the step's forward.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Remember what to load for ``request`` once its blocks are allocated.

        Called by the scheduler once per admission, after the KV allocator succeeded. Decide on
        ``num_external_tokens`` (0: load nothing), not on ``block_ids``.

        Args:
            request: the admitted request; its ``num_computed_tokens`` counts the local prefix hit, and the
                external tokens follow it.
            block_ids: the request's whole block table after the allocation, in token order.
            num_external_tokens: tokens to load, starting at the request's local prefix hit.
        """

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """What the workers must load and save this step; resets the per-step state of this side.

        Called by the scheduler at the end of every ``schedule()``; must not modify ``scheduler_output``.
        """

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Take the worker side's report of a step (finished transfers, load errors).

        Called by the scheduler in ``update_from_output`` before the step's tokens are applied. Default:
        nothing.
        """

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished (any reason, abort included), before its blocks are freed.

        Called by the scheduler exactly once per request.

        Returns:
            ``(delay_free, kv_transfer_params)``: True when the connector still reads the blocks (an
            asynchronous send) or still writes them (a request aborted while its asynchronous load is in flight):
            the engine keeps them until the worker side reports the request in ``get_finished`` (``sending``, or
            ``recving`` for a load); False frees them now (for such an aborted request: the connector cancelled
            its load and its worker side will not touch the blocks again). Parameters handed back to the caller
            with the request's output (vLLM's ``kv_transfer_params``), or None. Default ``(False, None)``.
        """
        return False, None

    # ---- worker side --------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Set this step's metadata; called by the model runner before the step's loads."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Forget this step's metadata; called by the model runner after the step's saves."""
        self._connector_metadata = None

    def connector_metadata(self) -> KVConnectorMetadata:
        """This step's metadata (inside a connector, between bind and clear).

        Raises:
            RuntimeError: no metadata is bound.
        """
        if self._connector_metadata is None:
            raise RuntimeError(f"kv connector {self.name!r}: no step metadata bound")
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        """Hand this rank's KV tensors to the worker side (vLLM passes ``{layer name: tensor}``).

        Called once by the worker after the model runner allocated its cache. Default: nothing.

        Args:
            kv_caches: one tensor per decoder layer, index = layer index, shaped
                ``backend.get_kv_cache_shape(num_blocks)`` in the cache dtype; block ``b`` of every tensor
                holds the K/V of the same tokens.
            backend: the attention backend that owns the layout: move whole blocks with
                ``backend.copy_blocks`` (any layout, scales included) into tensors of
                ``backend.get_kv_cache_shape(n)``.
        """

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start loading this step's external K/V into the paged cache (a synchronous connector loads it all
        here). Called by the model runner before the forward, after :meth:`bind_connector_metadata`."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s K/V of this step's loads is in the cache. Called by the model
        runner for every layer before the forward (layer-by-layer overlap with the forward is not built)."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Start saving layer ``layer_idx``'s K/V that this step's metadata names.

        Called by the model runner for every layer after the forward wrote the step's K/V.

        Args:
            layer_idx: decoder layer index.
            kv_layer: that layer's paged cache tensor (``backend.get_kv_cache_shape(num_blocks)``).
        """

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are done (the cache may be overwritten next step). Called by the
        model runner after every :meth:`save_kv_layer` of the step."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous transfers completed: ``(sending, recving)`` ids, or None each.

        Called by the model runner once per step (also on steps with nothing scheduled while transfers are in
        flight) with the requests finished since the previous one. A load's bad blocks must be reported by
        :meth:`get_block_ids_with_load_errors` no later than the step that reports the load in ``recving``.
        Default ``(None, None)`` (synchronous connector).
        """
        return None, None

    def get_kv_connector_kv_cache_events(self) -> list[Any] | None:
        """What this worker side's store gained or lost since the last call (plain values of the connector's
        choosing, e.g. ``("stored", key)`` / ``("removed", key)``), or None; vLLM's method of that name.

        Called by the model runner once per step after :meth:`get_block_ids_with_load_errors`; the driver rank's
        list reaches the scheduler side as ``KVConnectorOutput.kv_cache_events`` (:meth:`update_connector_output`),
        before the next ``schedule()``. A connector whose store lives on the worker (``offload``) tells its
        scheduler side what it can offer this way. Default: None.
        """
        return None

    def get_kv_connector_stats(self) -> list[tuple[int, float]] | None:
        """The transfers this worker side finished since the last call, one ``(bytes, seconds)`` each (vLLM's
        ``get_kv_connector_stats``, plain values), or None.

        Called by the model runner once per step; they reach the scheduler side's
        :class:`~framework.core.kv_transfer.KVTransfer` as ``KVConnectorOutput.kv_connector_stats`` and the metrics as
        ``SchedulerStats.num_kv_transfers`` / ``kv_transfer_bytes`` / ``kv_transfer_s``. Default: None.
        """
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed in this step (a synchronous connector reports them in the step it
        detected them). Called by the model runner after :meth:`wait_for_save`. The scheduler then recomputes
        the affected tokens or fails the request (``kv_transfer.load_failure_policy``). Default: none."""
        return set()

    def get_load_error_reasons(self) -> dict[int, str] | None:
        """Why blocks that :meth:`get_block_ids_with_load_errors` just reported failed: block id -> a message that
        names the fix (e.g. "the producer runs tensor_parallel_size=2 and this engine 1: ..."), or None.

        Called by the model runner once per step, right after :meth:`get_block_ids_with_load_errors`; the reasons
        reach the scheduler as ``KVConnectorOutput.load_error_reasons`` (ranks merged: the lowest rank's reason of a
        block wins), and a request failed under ``kv_transfer.load_failure_policy=fail`` carries its first bad block's
        reason in ``RequestOutput.error``. A block without a reason gets the generic message. Default: None.
        """
        return None
