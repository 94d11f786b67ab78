"""``kv_connector=offload`` under ``executor=sim``: the worker side of the offload connector, simulated.

The scheduler side is the real :class:`~plugins.kv_connectors.offload.OffloadConnector` (the engine builds it as for
any executor), so which prompt tokens the tiers supply, which requests park (``WAITING_FOR_REMOTE_KVS``) and the
``external_prefix_cache_*`` metrics come from the same code as a real run. Its worker side, which would copy bytes
between the KV cache and the tiers, is replaced by :class:`SimulatedOffload`: it keeps the tiers' contents in the
real :class:`~plugins.kv_connectors._tiers.TieredBlockStore` (same block keys, same LRU order, spills, promotions and
byte limits) over blocks that are ``meta`` tensors of the simulated block's size (no memory, no files), reports the
same store events, and prices every move by its bytes and its tier's bandwidth:

* a synchronous load (a CPU-tier hit, or a disk hit with ``async_load=False``) and every save add
  ``nbytes * 8 / (bandwidth_gbps * 1e9)`` seconds to the step (the real connector copies them before and after the
  forward, synchronously);
* an asynchronous load (a lookup that needs a disk block) runs on one simulated reader, in submission order, as the
  real connector's single background reader thread does; the request is reported loaded at the first step that
  ends after its last block is read.

Bandwidths are ``executor.params.offload_cpu_bandwidth_gbps`` (the CPU tier <-> device link; default
:data:`DEFAULT_CPU_BANDWIDTH_GBPS`) and ``executor.params.offload_disk_bandwidth_gbps`` (default
:data:`DEFAULT_DISK_BANDWIDTH_GBPS`), Gbit/s as ``kv_transfer.params.bandwidth_gbps``. Tier sizes are the
connector's own ``kv_connector.params.cpu_bytes`` / ``disk_bytes`` per rank (a block's bytes are one rank's shard,
``framework.sim.memory.kv_cache_bytes_per_block``: every rank holds its own tiers, as the real connector's worker
side does per rank); ``disk_path`` only switches the disk tier on (nothing is written).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from framework.config import EngineConfig
from framework.core.outputs import KVConnectorOutput
from plugins.kv_connectors._tiers import Block, TieredBlockStore, block_nbytes

DEFAULT_CPU_BANDWIDTH_GBPS = 400.0  # Gbit/s: PCIe 5.0 x16 host <-> device, ~50 GB/s of its 63 GB/s in practice
DEFAULT_DISK_BANDWIDTH_GBPS = 50.0  # Gbit/s: one PCIe 4.0 NVMe SSD's sequential read, ~6-7 GB/s
BANDWIDTH_PARAMS = ("offload_cpu_bandwidth_gbps", "offload_disk_bandwidth_gbps")


def simulated_offload(config: EngineConfig, block_bytes: int, cpu_bandwidth_gbps: float | None = None,
                      disk_bandwidth_gbps: float | None = None) -> SimulatedOffload | None:
    """``kv_connector=offload``'s simulated worker side for a replica of ``config`` (``None``: another connector;
    a bandwidth ``None``: its default), one KV block being ``block_bytes`` bytes on a rank.

    Raises:
        ValueError: a bandwidth <= 0.
    """
    if config.kv_connector != "offload":
        return None
    return SimulatedOffload(config.kv_connector_params, block_bytes,
                            DEFAULT_CPU_BANDWIDTH_GBPS if cpu_bandwidth_gbps is None else float(cpu_bandwidth_gbps),
                            DEFAULT_DISK_BANDWIDTH_GBPS if disk_bandwidth_gbps is None else float(disk_bandwidth_gbps))


class _CountingDisk:
    """Stands in for the tiers' disk writer: a disk-tier block stays "pending" (readable from memory: a ``meta``
    tensor, nothing held) until the store drops it, so the store never opens, writes or unlinks a file."""

    def __init__(self) -> None:
        self.pending: dict[str, Block] = {}
        self.lock = threading.Lock()
        self.folder = None

    def submit(self, key: str, block: Block) -> None:
        """The store spilled ``block`` to disk: keep it readable."""
        self.pending[key] = block

    def file(self, key: str) -> Any:
        """Never reached: every disk-tier block is pending (the store unlinks a file only for a written one).

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError(f"executor=sim's disk tier has no file for block {key}")

    def flush(self) -> None:
        """Nothing is written."""


class SimulatedTiers(TieredBlockStore):
    """:class:`TieredBlockStore`'s LRU tiers over ``meta`` blocks, its disk tier counted but never written.

    Args:
        cpu_bytes: the CPU tier's limit, bytes; disk_bytes: the disk tier's limit, bytes (0: no disk tier).
    """

    def __init__(self, cpu_bytes: int, disk_bytes: int) -> None:
        super().__init__(cpu_bytes, None, 0, layout=[])
        if disk_bytes:
            self.disk_bytes = disk_bytes
            self._writer = _CountingDisk()

    def close(self) -> None:
        """Nothing to stop or remove."""


class SimulatedOffload:
    """The worker side of ``kv_connector=offload`` for a simulated replica (see the module docstring).

    Args:
        connector_params: ``kv_connector.params`` (``cpu_bytes``, ``disk_path``, ``disk_bytes``; the real
            connector's defaults).
        block_bytes: bytes of one KV block on one rank.
        cpu_bandwidth_gbps, disk_bandwidth_gbps: each tier's bandwidth, Gbit/s.

    Raises:
        ValueError: a bandwidth <= 0.
    """

    def __init__(self, connector_params: dict[str, Any], block_bytes: int,
                 cpu_bandwidth_gbps: float = DEFAULT_CPU_BANDWIDTH_GBPS,
                 disk_bandwidth_gbps: float = DEFAULT_DISK_BANDWIDTH_GBPS) -> None:
        if cpu_bandwidth_gbps <= 0 or disk_bandwidth_gbps <= 0:
            raise ValueError(f"executor.params.offload_*_bandwidth_gbps must be > 0 Gbit/s, got "
                             f"{cpu_bandwidth_gbps}, {disk_bandwidth_gbps}")
        disk_bytes = int(connector_params.get("disk_bytes", 0)) if connector_params.get("disk_path") else 0
        self.store = SimulatedTiers(int(connector_params.get("cpu_bytes", 1 << 30)), disk_bytes)
        self.block_bytes = block_bytes
        self.bytes_per_s = {False: cpu_bandwidth_gbps * 1e9 / 8, True: disk_bandwidth_gbps * 1e9 / 8}
        self.reader_free_s = 0.0  # when the simulated background reader finishes its queue, seconds
        self.parked: dict[str, tuple[float, list[tuple[int, str, bool | None]]]] = {}  # rid -> (ready_s, loads)
        self.errors: set[int] = set()
        self.stats: list[tuple[int, float]] = []  # (bytes, seconds) of each finished load
        self.load_bytes = {"cpu": 0, "disk": 0}  # bytes loaded from each tier, whole run
        self.save_bytes = 0

    def _block(self) -> Block:
        """A block of the simulated size that holds no memory."""
        return [torch.empty(self.block_bytes, dtype=torch.uint8, device="meta")]

    def _seconds(self, nbytes: int, from_disk: bool) -> float:
        """Seconds to move ``nbytes`` to or from the disk tier (``from_disk``) or the CPU tier."""
        return nbytes / self.bytes_per_s[from_disk]

    def start_step(self, metadata: Any, now_s: float) -> float:
        """Apply one step's :class:`~plugins.kv_connectors.offload.OffloadMetadata` (cancels, asynchronous and
        synchronous loads, then saves, as the real worker side orders them) at time ``now_s``.

        Returns:
            Seconds the step spends on synchronous loads and saves.
        """
        if metadata is None:
            return 0.0
        for rid in metadata.cancels:
            self.parked.pop(rid, None)
        for block_id, key, rid in metadata.async_loads:
            found = self.store.locate(key)
            from_disk = None if found is None else found[1]
            if from_disk is not None:
                self.reader_free_s = max(self.reader_free_s, now_s) + self._seconds(self.block_bytes, from_disk)
            _, loads = self.parked.get(rid, (0.0, []))
            self.parked[rid] = (max(self.reader_free_s, now_s), loads + [(block_id, key, from_disk)])
        seconds, failed, promote = 0.0, set(), []
        for block_id, key, rid in metadata.loads:
            found = self.store.get(key)
            if found is None:  # the real worker side's load error: the scheduler recomputes or fails the request
                self.errors.add(block_id)
                failed.add(rid)
                continue
            block, from_disk = found
            seconds += self._load(block, from_disk)
            if from_disk:
                promote.append((key, block))
        for key, block in promote:
            self.store.put(key, block)
        for _, key, rid in metadata.saves:
            if rid not in failed:
                self.store.put(key, self._block())
                self.save_bytes += self.block_bytes
                seconds += self._seconds(self.block_bytes, False)
        return seconds

    def _load(self, block: Block, from_disk: bool) -> float:
        """Count one block's load; its seconds."""
        nbytes = block_nbytes(block)
        seconds = self._seconds(nbytes, from_disk)
        self.load_bytes["disk" if from_disk else "cpu"] += nbytes
        self.stats.append((nbytes, seconds))
        return seconds

    def next_ready_s(self) -> float | None:
        """When the earliest parked request's loads complete (None: none parked), seconds."""
        return min((ready for ready, _ in self.parked.values()), default=None)

    def finish_step(self, now_s: float) -> KVConnectorOutput:
        """The step's report at time ``now_s``: parked requests whose reads are done (their disk blocks promoted
        to the CPU tier, as the real ``get_finished`` does), load errors, the store's events and load stats."""
        done = [rid for rid, (ready, _) in self.parked.items() if ready <= now_s]
        for rid in done:
            for block_id, key, from_disk in self.parked.pop(rid)[1]:
                found = self.store.locate(key) if from_disk is not None else None
                if found is None:  # absent at lookup, or dropped while the read was queued
                    self.errors.add(block_id)
                    continue
                self._load(found[0], from_disk)
                if from_disk or key in self.store.disk:
                    self.store.put(key, found[0])
        errors, self.errors = self.errors, set()
        stats, self.stats = self.stats, []
        return KVConnectorOutput(finished_recving=set(done) or None, invalid_block_ids=errors,
                                 kv_cache_events=self.store.take_events() or None, kv_connector_stats=stats or None)
