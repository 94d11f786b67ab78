"""``kv_connector=memory``: full prompt blocks kept in a process-wide dict, keyed like ``shared_storage``.

A producer ``LLM`` and a consumer ``LLM`` in one Python process share the store (the class attribute
:attr:`MemoryConnector.store`); the smallest synchronous connector that passes ``check_kv_connector``, also with one
worker side per tensor-parallel rank (``tp_size=2``): each rank stores its own shard of a block under the block's key
and its ``kv_shard.tag``, and a block is offered only once every rank stored its shard. (The store is one process's:
under ``executor=mp`` the ranks run in processes of their own, so an engine needs a store they share, as
``shared_storage``'s folder.)"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from framework.core.outputs import KVConnectorMetadata
from framework.interfaces import KVConnector
from framework.interfaces.kv_connector import prefix_block_hashes


@dataclass
class MemoryMoves(KVConnectorMetadata):
    """One step's block moves."""

    loads: list[tuple[int, str]] = field(default_factory=list)  # (block id, key): copied in before the forward
    saves: list[tuple[int, str]] = field(default_factory=list)  # (block id, key): copied out after the forward


class MemoryConnector(KVConnector):
    """Blocks in :attr:`store` (key -> one CPU tensor per layer, ``backend.get_kv_cache_shape(1)``)."""

    name = "memory"
    interface_version = 1
    store: ClassVar[dict[tuple[str, str], list[torch.Tensor | None]]] = {}  # (key, shard tag) -> per layer

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._loads: list[tuple[int, str]] = []
        self._caches: list[torch.Tensor] = []
        self._backend: Any = None

    def _keys(self, request: Any) -> list[str]:
        return prefix_block_hashes(request.prompt_token_ids, self.block_size)

    def _stored(self, key: str) -> bool:
        """Every rank of this engine's layout stored its shard of block ``key``."""
        return all((key, shard.tag) in self.store for shard in self.kv_shard.all_ranks())

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Stored blocks after the local hit, never the block of the last prompt token."""
        keys = self._keys(request)[:(request.num_prompt_tokens - 1) // self.block_size]
        first = end = num_computed_tokens // self.block_size
        while self.is_consumer and end < len(keys) and self._stored(keys[end]):
            end += 1
        return (end - first) * self.block_size, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Queue the blocks to load, after the local hit."""
        first = request.num_computed_tokens // self.block_size
        keys = self._keys(request)
        self._loads += [(block_ids[i], keys[i]) for i in range(first, first + num_external_tokens // self.block_size)]

    def build_connector_meta(self, scheduler_output: Any) -> MemoryMoves:
        """The queued loads; a producer saves every full prompt block this step completes."""
        meta, self._loads = MemoryMoves(loads=self._loads), []
        for request in scheduler_output.scheduled_requests if self.is_producer else ():
            done = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[request.request_id]
            keys = self._keys(request)[:min(done, request.num_prompt_tokens) // self.block_size]
            meta.saves += list(zip(scheduler_output.block_ids[request.request_id][0], keys))
        return meta

    def register_kv_caches(self, kv_caches: list[torch.Tensor], backend: Any) -> None:
        """Keep the caches and the backend that copies their blocks."""
        self._caches, self._backend = kv_caches, backend

    def start_load_kv(self, **kwargs: Any) -> None:
        """Copy this rank's shard of every queued block in."""
        for block, key in self.connector_metadata().loads:
            self._backend.copy_blocks(self.store[key, self.kv_shard.tag], [0], self._caches, [block])

    def wait_for_layer_load(self, layer_idx: int) -> None:
        """Loaded already."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Copy this layer of this rank's shard of every block to save out."""
        for block, key in self.connector_metadata().saves:
            layers = self.store.setdefault((key, self.kv_shard.tag), [None] * len(self._caches))
            layers[layer_idx] = torch.empty(self._backend.get_kv_cache_shape(1), dtype=kv_layer.dtype)
            self._backend.copy_blocks([kv_layer], [block], [layers[layer_idx]], [0])

    def wait_for_save(self) -> None:
        """Saved already."""
