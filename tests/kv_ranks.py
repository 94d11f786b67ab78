"""What a KV connector test asks of each rank through ``executor.collective_rpc`` (tests/plugins/kv_connectors):
blocks of the rank's KV cache shard, and the zmq threads alive in the rank's process.

Importable by the worker processes because ``tests/`` is on pytest's pythonpath (the ranks are forked from a
server that the test process started, with its ``sys.path``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch


def rank_kv_blocks(worker: Any, block_ids: list[int]) -> list[torch.Tensor]:
    """Blocks ``block_ids`` of every layer of this rank's KV cache (its KV heads' shard): one CPU tensor per layer,
    the blocks gathered along the layout's block dimension, in the order given."""
    from plugins.kv_connectors._zmq_wire import block_dim_of, gather_blocks

    backend = worker.backend
    block_dim = block_dim_of(backend.get_kv_cache_shape(1), backend.get_kv_cache_shape(2))
    return gather_blocks(worker.runner.kv_caches, block_ids, block_dim)


def zmq_threads(worker: Any = None) -> list[str]:
    """This process's threads that belong to zmq: the connector's Python threads (``kv-zmq-*``) and libzmq's own
    (``ZMQbg/*``: they live as long as some zmq context does)."""
    names = [t.name for t in threading.enumerate() if "zmq" in t.name]
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if comm.startswith("ZMQbg"):
            names.append(comm)
    return names


def close_kv_connector(worker: Any) -> tuple[list[str], list[str]]:
    """Close this rank's KV connector worker side: ``(zmq threads before, zmq threads after)``."""
    before = zmq_threads()
    worker.runner.kv_connector.connector.close()
    return before, zmq_threads()
