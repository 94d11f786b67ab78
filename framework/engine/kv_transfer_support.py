"""``kv_connector=<name>``: what the engine refuses before weights load, and the scheduler side it builds
(docs/kv_transfer.md)."""

from __future__ import annotations

from framework import registry
from framework.config import EngineConfig
from framework.core.kv_transfer import KVTransfer
from framework.interfaces import KVConnectorRole
from framework.interfaces.kv_connector import KVShard

_NOT_YET = "not built yet for kv_connector (docs/kv_transfer.md)"


def kv_transfer_problems(config: EngineConfig) -> list[str]:
    """Why ``config``'s KV connector cannot run (empty: it can, or ``kv_connector=none``), each naming the fix:
    ``executor=uniproc`` (one rank) or ``executor=mp`` (one worker side per rank, tensor parallelism included; the
    executor merges their reports), no pipeline parallelism (a stage holds only its layers' caches: not built), no
    ``ray`` (not built); ``executor=sim`` simulates the worker side of ``offload`` at any simulated TP degree
    (plugins/executors/_sim_offload.py), ``kv_cache=paged`` (it drops single blocks from its prefix
    cache after a failed load) and ``engine.kv_cache_dtype=auto`` (quantized caches are not checked)."""
    if config.kv_connector == "none":
        return []
    sim_offload = config.executor == "sim" and config.kv_connector == "offload"
    checks = [
        (config.executor in ("uniproc", "mp") or sim_offload,
         f"executor={config.executor} is {_NOT_YET}; use executor=uniproc (one rank) or executor=mp (tensor "
         "parallelism); executor=sim simulates kv_connector=offload"),
        (config.tensor_parallel_size == 1 or config.executor == "mp" or sim_offload,
         f"tensor_parallel_size > 1 with executor={config.executor} is {_NOT_YET}; use executor=mp"),
        (config.pipeline_parallel_size == 1,
         f"pipeline_parallel_size > 1 is {_NOT_YET}; use parallel.pipeline_parallel_size=1"),
        (config.kv_allocator == "paged", f"kv_cache={config.kv_allocator} is {_NOT_YET}; use kv_cache=paged"),
        (config.kv_cache_dtype == "auto",
         f"engine.kv_cache_dtype={config.kv_cache_dtype} is {_NOT_YET}; use engine.kv_cache_dtype=auto"),
    ]
    return [message for ok, message in checks if not ok]


def make_kv_transfer(config: EngineConfig) -> KVTransfer | None:
    """The scheduler side of ``config.kv_connector`` (role ``SCHEDULER``), or ``None`` for ``none``; its
    ``kv_shard`` names the engine's layout (``KVShard(0, tensor_parallel_size)``: a block is whole once every rank's
    shard is stored)."""
    connector = registry.create("kv_connector", config.kv_connector, role=KVConnectorRole.SCHEDULER,
                                block_size=config.block_size, kv_role=config.kv_role,
                                **config.plugin_params("kv_connector"))
    if connector is None:
        return None
    connector.kv_shard = KVShard(0, config.tensor_parallel_size)
    return KVTransfer(connector, config.kv_load_failure_policy)
