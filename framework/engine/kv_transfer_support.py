"""``kv_connector=<name>``: what the engine refuses before weights load, and the scheduler side it builds
(docs/kv_transfer.md)."""

from __future__ import annotations

from framework import registry
from framework.config import EngineConfig
from framework.core.kv_transfer import KVTransfer
from framework.interfaces import KVConnectorRole
from framework.worker.kv_connector_runner import kv_shard_of

_NOT_YET = "not built yet for kv_connector (docs/kv_transfer.md)"


def kv_transfer_problems(config: EngineConfig) -> list[str]:
    """Why ``config``'s KV connector cannot run (empty: it can, or ``kv_connector=none``), each naming the fix:
    ``executor=uniproc`` (one rank), ``executor=mp`` or ``executor=ray`` (one worker side per rank, tensor and
    pipeline parallelism included; the executor merges their reports); ``executor=sim`` simulates the worker side
    of ``offload`` at any simulated TP degree (plugins/executors/_sim_offload.py); ``zmq`` with one stage under
    ``mp`` or ``uniproc`` (its pull server and ``kv_transfer_params`` name no stage); ``kv_cache=paged`` (it drops
    single blocks from its prefix cache after a failed load) and ``engine.kv_cache_dtype=auto`` (quantized caches
    are not checked)."""
    if config.kv_connector == "none":
        return []
    sim_offload = config.executor == "sim" and config.kv_connector == "offload"
    ranks = config.executor in ("mp", "ray")  # executors whose ranks each run a worker side, reports merged
    checks = [
        (config.executor == "uniproc" or ranks or sim_offload,
         f"executor={config.executor} is {_NOT_YET}; use executor=uniproc (one rank), executor=mp or executor=ray "
         "(tensor and pipeline parallelism); executor=sim simulates kv_connector=offload"),
        (config.tensor_parallel_size == 1 or ranks or sim_offload,
         f"tensor_parallel_size > 1 with executor={config.executor} is {_NOT_YET}; use executor=mp or executor=ray"),
        (config.kv_connector != "zmq" or (config.pipeline_parallel_size == 1 and config.executor != "ray"),
         f"kv_connector=zmq with pipeline_parallel_size={config.pipeline_parallel_size} and executor="
         f"{config.executor} is {_NOT_YET} (its pull server names no stage); use parallel.pipeline_parallel_size=1 "
         "and executor=mp or executor=uniproc"),
        (config.kv_allocator == "paged", f"kv_cache={config.kv_allocator} is {_NOT_YET}; use kv_cache=paged"),
        (config.kv_cache_dtype == "auto",
         f"engine.kv_cache_dtype={config.kv_cache_dtype} is {_NOT_YET}; use engine.kv_cache_dtype=auto"),
    ]
    return [message for ok, message in checks if not ok]


def make_kv_transfer(config: EngineConfig, num_layers: int = 0) -> KVTransfer | None:
    """The scheduler side of ``config.kv_connector`` (role ``SCHEDULER``), or ``None`` for ``none``; its
    ``kv_shard`` names the engine's layout (``kv_shard_of(config, num_layers)``: rank 0 of stage 0 of
    ``tensor_parallel_size`` ranks over every stage's layers; a block is whole once every rank's shard is stored).

    Args:
        num_layers: the model's decoder layers (needed under pipeline parallelism, to name every stage's layers).

    Raises:
        ValueError: ``pipeline_parallel_size > 1`` without ``num_layers``.
    """
    if config.pipeline_parallel_size > 1 and num_layers < 1:
        raise ValueError("make_kv_transfer needs the model's num_layers under pipeline parallelism")
    connector = registry.create("kv_connector", config.kv_connector, role=KVConnectorRole.SCHEDULER,
                                block_size=config.block_size, kv_role=config.kv_role,
                                **config.plugin_params("kv_connector"))
    if connector is None:
        return None
    connector.kv_shard = kv_shard_of(config, num_layers)
    return KVTransfer(connector, config.kv_load_failure_policy)
