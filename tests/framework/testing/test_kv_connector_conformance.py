"""The KV connector conformance kit (framework/testing/kv_connector.py) passes a minimal in-memory connector, the
shape of a third-party one, one rank or two (tensor parallelism: one worker side per rank, each over its own shard),
and catches a connector that offers the block of the last prompt token or mixes the ranks' shards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from framework.core.outputs import KVConnectorMetadata
from framework.interfaces import KVConnector
from framework.interfaces.kv_connector import prefix_block_hashes
from framework.testing import check_kv_connector
from plugins.attention.torch_paged import TorchPagedAttentionBackend


@dataclass
class _Moves(KVConnectorMetadata):
    loads: list[tuple[int, str]] = field(default_factory=list)
    saves: list[tuple[int, str]] = field(default_factory=list)


class MemoryConnector(KVConnector):
    """Blocks in a class-level dict (one store per test), keyed like shared_storage."""

    name = "memory"
    store: ClassVar[dict[str, list[torch.Tensor]]] = {}
    greedy = False  # True: also offers the block of the last prompt token (breaks vLLM's rule)
    sharded = True  # False: keys ignore the rank (breaks tensor parallelism: the ranks' shards overwrite each other)

    def _key(self, key, shard=None):
        return f"{key}.{(shard or self.kv_shard).tag}" if self.sharded else key

    def _stored(self, key):
        return all(self._key(key, shard) in self.store for shard in self.kv_shard.all_ranks())

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._loads: list[tuple[int, str]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        keys = prefix_block_hashes(request.prompt_token_ids, self.block_size)
        if not self.greedy:
            keys = keys[:(request.num_prompt_tokens - 1) // self.block_size]
        first = end = num_computed_tokens // self.block_size
        while self.is_consumer and end < len(keys) and self._stored(keys[end]):
            end += 1
        return (end - first) * self.block_size, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        keys = prefix_block_hashes(request.prompt_token_ids, self.block_size)
        first = request.num_computed_tokens // self.block_size
        self._loads += [(block_ids[i], keys[i]) for i in range(first, first + num_external_tokens // self.block_size)]

    def build_connector_meta(self, scheduler_output):
        meta, self._loads = _Moves(loads=self._loads), []
        if self.is_producer:
            for request in scheduler_output.scheduled_requests:
                keys = prefix_block_hashes(request.prompt_token_ids, self.block_size)
                table = scheduler_output.block_ids[request.request_id][0]
                meta.saves += list(zip(table, keys))
        return meta

    def register_kv_caches(self, kv_caches, backend):
        self.caches, self.backend = kv_caches, backend

    def start_load_kv(self, **kwargs):
        for block, key in self.connector_metadata().loads:
            self.backend.copy_blocks(self.store[self._key(key)], [0], self.caches, [block])

    def wait_for_layer_load(self, layer_idx):
        pass  # loads finish inside start_load_kv: nothing to wait for

    def save_kv_layer(self, layer_idx, kv_layer, **kwargs):
        for block, key in self.connector_metadata().saves:
            layers = self.store.setdefault(self._key(key), [None] * len(self.caches))
            layers[layer_idx] = torch.empty(self.backend.get_kv_cache_shape(1), dtype=kv_layer.dtype)
            self.backend.copy_blocks([kv_layer], [block], [layers[layer_idx]], [0])

    def wait_for_save(self):
        pass  # saves finish inside save_kv_layer: nothing to wait for


@pytest.fixture
def backend():
    return TorchPagedAttentionBackend(num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5, block_size=4,
                                      dtype=torch.float32, device=torch.device("cpu"),
                                      compile=False)  # eager: the kit checks the connector, not the kernel


@pytest.mark.parametrize("tp_size", [1, 2])
def test_memory_connector_passes(backend, tp_size):
    MemoryConnector.store = {}
    check_kv_connector(MemoryConnector, backend, num_layers=3, tp_size=tp_size)


def test_kit_catches_a_store_that_mixes_the_ranks_shards(backend):
    class Unsharded(MemoryConnector):
        sharded = False

    Unsharded.store = {}
    check_kv_connector(Unsharded, backend)  # one rank: fine
    Unsharded.store = {}
    with pytest.raises(AssertionError, match="rank 0 of 2: a rank must load its own shard"):
        check_kv_connector(Unsharded, backend, tp_size=2)


def test_kit_catches_a_load_of_the_last_token_block(backend):
    class Greedy(MemoryConnector):
        greedy = True

    Greedy.store = {}
    with pytest.raises(AssertionError, match="last prompt token"):
        check_kv_connector(Greedy, backend)


def test_engine_kit_passes_shared_storage_and_catches_a_connector_that_skips_its_loads(tmp_path):
    """check_kv_connector_engine on one in-process rank: shared_storage passes; a connector that offers stored
    blocks but never copies them in leaves garbage K/V, and the kit names the prompt whose output differs."""
    from framework import hookimpl, registry
    from framework.testing import check_kv_connector_engine
    from plugins.kv_connectors.shared_storage import SharedStorageConnector

    model = str(Path(__file__).resolve().parents[3] / "models" / "stories260K")
    check_kv_connector_engine("shared_storage", model, connector_params={"path": str(tmp_path / "ok")})

    class SkipsLoads(SharedStorageConnector):
        name = "skips_loads"

        def start_load_kv(self, **kwargs):
            """Loads nothing (the bug under test)."""

    class _Plugin:
        @hookimpl
        def register_kv_connectors(self, register):
            register("skips_loads", SkipsLoads)

    with registry.registered(_Plugin()), pytest.raises(AssertionError, match="must be token-exact"):
        check_kv_connector_engine("skips_loads", model, connector_params={"path": str(tmp_path / "bad")})
