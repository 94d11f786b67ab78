"""``kv_connector=shared_storage``: every full prompt block's K/V as one safetensors file in a shared folder.

vLLM's example connector (``SharedStorageConnector``), synchronous: a producer (``kv_transfer.role=kv_producer``
or ``kv_both``) writes each full prompt block after the forward that computed it, all layers in one file named by
the block's prefix key (:func:`framework.interfaces.kv_connector.prefix_block_hashes`); a consumer (``kv_consumer``
or ``kv_both``) counts the consecutive stored blocks beyond its local prefix hit and reads them into its freshly
allocated blocks before the forward. On a full-prompt hit the last prompt block is computed, not loaded: the last
prompt token's logits are needed (vLLM's rule). Blocks move through the attention backend's ``copy_blocks``, so
the bytes on disk are the cache's own (any layout), and a load is bitwise the producer's K/V.

A file is written to a temporary name and renamed, so a reader never sees half a block. One folder serves one
model, dtype, block size and attention backend: a file whose tensors do not fit the cache fails to load (reported
through ``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import KVConnector, KVConnectorMetadata, KVConnectorRole
from framework.interfaces.kv_connector import KVShard, prefix_block_hashes

if TYPE_CHECKING:
    from framework.config import EngineConfig
    from framework.core.outputs import SchedulerOutput
    from framework.core.request import Request
    from framework.interfaces import AttentionBackend

logger = logging.getLogger(__name__)


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    """One step's block moves (plain values: it travels to every rank)."""

    loads: list[tuple[int, str]] = field(default_factory=list)  # (block id, key): read before the forward
    saves: list[tuple[int, str]] = field(default_factory=list)  # (block id, key): written after the forward


class SharedStorageConnector(KVConnector):
    """Stores and loads full prompt blocks as ``<path>/<key>.safetensors`` (tensors ``layer.<i>``, each one
    block of layer ``i``'s cache, ``backend.get_kv_cache_shape(1)``).

    Args:
        role, block_size, kv_role: see :class:`~framework.interfaces.KVConnector`.
        path: the shared folder (``kv_connector.params.path``); created when missing.

    Raises:
        ValueError: ``path`` empty.
    """

    name = "shared_storage"

    def __init__(self, role: KVConnectorRole, block_size: int, kv_role: str = "kv_both", path: str = "",
                 **params: Any) -> None:
        super().__init__(role, block_size, kv_role, **params)
        if not path:
            raise ValueError("kv_connector=shared_storage needs kv_connector.params.path (a folder)")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        # scheduler side: this step's loads, and per request the prompt blocks whose save was already asked
        self._loads: list[tuple[int, str]] = []
        self._num_saved: dict[str, int] = {}
        # worker side
        self._kv_caches: list[torch.Tensor] = []
        self._backend: AttentionBackend | None = None
        self._pending: dict[str, list[torch.Tensor | None]] = {}  # key -> one block per layer, to write
        self._load_errors: set[int] = set()
        self._load_error_reasons: dict[int, str] = {}  # bad block -> why its file did not load
        self._warned_layout = False  # scheduler side: the other-layout warning was given

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Also: ``kv_connector.params.path`` must be set."""
        problems = super().validate(config)
        if not config.kv_connector_params.get("path"):
            problems.append("kv_connector=shared_storage needs kv_connector.params.path=<folder shared by the "
                            "producer and the consumer>")
        return problems

    def _file(self, key: str, shard: KVShard | None = None) -> Path:
        """The file of ``shard``'s part of block ``key`` (default: this instance's shard)."""
        tag = (shard or self.kv_shard).tag
        return self.path / (f"{key}.{tag}.safetensors" if tag else f"{key}.safetensors")

    def _stored(self, key: str) -> bool:
        """True when every rank of this engine's layout stored its shard of block ``key``."""
        return all(self._file(key, shard).is_file() for shard in self.kv_shard.all_ranks())

    def _warn_other_layout(self, key: str) -> None:
        """Say once that the folder holds block ``key`` for another layout only (tensor-parallel size, stages; never
        loaded here)."""
        if self._warned_layout:
            return
        others = sorted(p.name for p in self.path.glob(f"{key}*.safetensors"))
        if others:
            self._warned_layout = True
            shard = self.kv_shard
            logger.warning("kv_connector=shared_storage: %s holds block %s only as %s, stored by an engine of another "
                           "parallel layout; this engine (tensor_parallel_size=%d, pipeline_parallel_size=%d, stages "
                           "%s) loads only its own layout's files: run the producer and the consumer with the same "
                           "tensor_parallel_size, pipeline_parallel_size and pp_layer_partition",
                           self.path, key, ", ".join(others), shard.tp_size, shard.pp_size,
                           [f"{a}-{b}" for a, b in shard.stage_layers] or "all layers")

    def _keys(self, request: Request) -> list[str]:
        """Prefix keys of the request's full prompt blocks (salted with its LoRA adapter's name)."""
        salt = request.lora_request.lora_name if request.lora_request is not None else ""
        return prefix_block_hashes(request.prompt_token_ids, self.block_size, salt)

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Consecutive stored prompt blocks from block ``num_computed_tokens / block_size`` on, in tokens; the
        block holding the last prompt token is never counted (it is computed for its logits)."""
        if not self.is_consumer:
            return 0, False
        num_loadable = (request.num_prompt_tokens - 1) // self.block_size  # blocks before the last prompt token
        keys = self._keys(request)[:num_loadable]
        first = num_computed_tokens // self.block_size
        end = first
        while end < len(keys) and self._stored(keys[end]):
            end += 1
        if end < len(keys):
            self._warn_other_layout(keys[end])
        return (end - first) * self.block_size, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the loads of the ``num_external_tokens / block_size`` blocks after the local hit."""
        if not num_external_tokens:
            return
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        keys = self._keys(request)
        self._loads += [(block_ids[i], keys[i]) for i in range(first, last)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        """This step's loads, and (producer) the saves of every prompt block this step completes."""
        meta = SharedStorageMetadata(loads=self._loads)
        self._loads = []
        for rid in scheduler_output.finished_req_ids:
            self._num_saved.pop(rid, None)
        if not self.is_producer:
            return meta
        for request in scheduler_output.scheduled_requests:
            rid = request.request_id
            done = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[rid]
            num_full = min(done, request.num_prompt_tokens) // self.block_size
            start = self._num_saved.get(rid, 0)
            if num_full > start:
                keys, table = self._keys(request), scheduler_output.block_ids[rid][0]
                meta.saves += [(table[i], keys[i]) for i in range(start, num_full)]
                self._num_saved[rid] = num_full
        return meta

    # ---- worker side ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        """Keep the rank's per-layer caches and the backend that copies their blocks."""
        self._kv_caches, self._backend = list(kv_caches), backend

    def _block_buffers(self) -> list[torch.Tensor]:
        """One empty block per layer, shaped and typed like the cache's blocks, on the CPU."""
        shape = self._backend.get_kv_cache_shape(1)
        return [torch.empty(shape, dtype=t.dtype) for t in self._kv_caches]

    def start_load_kv(self, **kwargs: Any) -> None:
        """Read every queued block's file into its block (synchronous); a missing, corrupt or mismatched file
        leaves the block as it was and is reported by :meth:`get_block_ids_with_load_errors`."""
        from safetensors.torch import load_file

        for block, key in self.connector_metadata().loads:
            try:
                tensors = load_file(self._file(key))
                buffers = self._block_buffers()
                for i, buffer in enumerate(buffers):
                    stored = tensors[f"layer.{i}"]
                    if stored.shape != buffer.shape or stored.dtype != buffer.dtype:
                        raise ValueError(f"layer {i}: stored {tuple(stored.shape)} {stored.dtype}, cache block "
                                         f"{tuple(buffer.shape)} {buffer.dtype}")
                    buffer.copy_(stored)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is a load error of that block
                logger.warning("kv_connector=shared_storage: block %s (%s) failed to load: %s", block, key, exc)
                self._load_errors.add(block)
                self._load_error_reasons[block] = (f"{self._file(key)} did not load ({exc}); one folder serves one "
                                                   "model, dtype, block size and attention backend")
                continue
            self._backend.copy_blocks(buffers, [0], self._kv_caches, [block])

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Nothing to wait for: :meth:`start_load_kv` loaded every layer."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Copy this layer's part of every block to save into a CPU buffer (files not yet stored, blocks whose
        load did not fail this step)."""
        for block, key in self.connector_metadata().saves:
            if block in self._load_errors or self._file(key).is_file():
                continue
            layers = self._pending.setdefault(key, [None] * len(self._kv_caches))
            buffer = self._backend.get_kv_cache_shape(1)
            layers[layer_idx] = torch.empty(buffer, dtype=kv_layer.dtype)
            self._backend.copy_blocks([kv_layer], [block], [layers[layer_idx]], [0])

    def wait_for_save(self) -> None:
        """Write each buffered block as one file (temporary name, then an atomic rename)."""
        from safetensors.torch import save_file

        pending, self._pending = self._pending, {}
        for key, layers in pending.items():
            tmp = self.path / f".{key}.{os.getpid()}.tmp"
            save_file({f"layer.{i}": t.contiguous() for i, t in enumerate(layers) if t is not None}, tmp)
            os.replace(tmp, self._file(key))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose file failed to load in this step (then forgotten)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_load_error_reasons(self) -> dict[int, str] | None:
        """Why each block of :meth:`get_block_ids_with_load_errors` failed (its file and the error), then forgotten."""
        reasons, self._load_error_reasons = self._load_error_reasons, {}
        return reasons or None


@hookimpl
def register_kv_connectors(register: Register) -> None:
    """Register ``shared_storage``."""
    register("shared_storage", SharedStorageConnector)
