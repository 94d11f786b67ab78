"""The worker side of a KV connector around one rank's steps (``kv_connector=<name>``; docs/kv_transfer.md).

The model runner calls :meth:`KVConnectorRunner.start_step` after the step's swaps and before its forward (bind
the metadata, start the loads, wait for every layer's) and :meth:`KVConnectorRunner.end_step` after the forward
(save every layer, wait for the saves, collect finished transfers and load errors), as vLLM V1's
``KVConnectorModelRunnerMixin`` does. Layer-by-layer overlap of loads and saves with the forward is not built: the
layer hooks run for every layer before and after it. While an asynchronous load or a delayed free is in flight the
engine also sends steps that schedule nothing; they run both calls too (no forward), so ``get_finished`` is polled.
Under tensor and pipeline parallelism every rank runs one (its own KV heads' shard of its own stage's layers: a
stage registers only its layers' caches, as vLLM's worker does); the executor merges every rank's report
(``framework/executor/kv_output_aggregator.py``).
"""

from __future__ import annotations

import torch

from framework import registry
from framework.config import EngineConfig
from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput
from framework.interfaces import AttentionBackend, KVConnector, KVConnectorRole
from framework.interfaces.kv_connector import KVShard
from framework.model_executor.pipeline_parallel import get_pp_indices


class KVConnectorRunner:
    """Drives ``connector`` (role ``WORKER``) over the rank's per-layer KV caches.

    Args:
        connector: the worker-side instance.
        kv_caches: one tensor per decoder layer (``ModelRunner.kv_caches``), handed to ``register_kv_caches``.
        backend: the rank's attention backend (owns the cache layout).
    """

    def __init__(self, connector: KVConnector, kv_caches: list[torch.Tensor], backend: AttentionBackend) -> None:
        self.connector = connector
        self.kv_caches = kv_caches
        connector.register_kv_caches(kv_caches, backend)
        self._bound = False

    def start_step(self, metadata: KVConnectorMetadata | None) -> None:
        """Bind the step's metadata and load (``None``: nothing to do this step)."""
        self._bound = metadata is not None
        if not self._bound:
            return
        self.connector.bind_connector_metadata(metadata)
        self.connector.start_load_kv()
        for layer_idx in range(len(self.kv_caches)):
            self.connector.wait_for_layer_load(layer_idx)

    def end_step(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Save, then report: finished transfers, the blocks that failed to load this step (and why) and the store's
        events."""
        if self._bound:
            for layer_idx, kv_layer in enumerate(self.kv_caches):
                self.connector.save_kv_layer(layer_idx, kv_layer)
            self.connector.wait_for_save()
        sending, recving = self.connector.get_finished(set(finished_req_ids))
        output = KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                   invalid_block_ids=self.connector.get_block_ids_with_load_errors(),
                                   load_error_reasons=self.connector.get_load_error_reasons(),
                                   kv_cache_events=self.connector.get_kv_connector_kv_cache_events(),
                                   kv_connector_stats=self.connector.get_kv_connector_stats())
        if self._bound:
            self.connector.clear_connector_metadata()
            self._bound = False
        return output


def kv_shard_of(config: EngineConfig, num_layers: int, tp_rank: int = 0, pp_rank: int = 0) -> KVShard:
    """The shard of every KV block that TP rank ``tp_rank`` of pipeline stage ``pp_rank`` holds (the scheduler
    side's: ``0, 0``, the engine's layout): its KV heads and, under ``pipeline_parallel_size > 1``, its stage's
    layers, every stage's ``[start, end)`` from ``get_pp_indices`` over the model's ``num_layers`` decoder layers
    (``parallel.pp_layer_partition`` included), as the stages split the model."""
    pp = config.pipeline_parallel_size
    stages = () if pp == 1 else tuple(get_pp_indices(num_layers, stage, pp, config.pp_layer_partition)
                                      for stage in range(pp))
    return KVShard(tp_rank, config.tensor_parallel_size, pp_rank, stages)


def make_kv_connector_runner(config: EngineConfig, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                             num_kv_cache_groups: int, tp_rank: int = 0, pp_rank: int = 0) -> KVConnectorRunner | None:
    """This rank's worker side of ``config.kv_connector`` (``None`` for ``none``), told its shard
    (:func:`kv_shard_of`: this rank's KV heads of its stage's layers) before it sees the caches; every rank builds
    one (vLLM V1: one worker-side connector per worker).

    Args:
        kv_caches: one tensor per decoder layer of the model (``ModelRunner.kv_caches``; under pipeline parallelism
            the other stages' layers are empty stand-ins): the connector registers only its stage's layers'.
        tp_rank, pp_rank: this rank's tensor-parallel rank and pipeline stage.

    Raises:
        ValueError: the model has several KV cache groups (sliding-window layers), which no connector moves yet.
    """
    if config.kv_connector == "none":
        return None
    if num_kv_cache_groups > 1:
        raise ValueError(f"kv_connector={config.kv_connector} moves one block table per request; this model has "
                         f"{num_kv_cache_groups} KV cache groups (sliding-window layers): use kv_connector=none")
    connector = registry.create("kv_connector", config.kv_connector, role=KVConnectorRole.WORKER,
                                block_size=config.block_size, kv_role=config.kv_role,
                                **config.plugin_params("kv_connector"))
    connector.kv_shard = shard = kv_shard_of(config, len(kv_caches), tp_rank, pp_rank)
    start, end = shard.stage_layers[pp_rank] if shard.stage_layers else (0, len(kv_caches))
    return KVConnectorRunner(connector, kv_caches[start:end], backend)
