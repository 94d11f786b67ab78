"""GB/s of a ``kv_connector=zmq`` prefill -> decode transfer between two processes on one host.

A producer process holds a KV cache shaped like a real model's (default: Llama-3-8B's 32 layers, 8 KV heads of 128
channels, bfloat16, 16-token blocks: 4 MiB per block over all layers) and runs the ``zmq`` connector's worker side
(its ROUTER server thread); this process runs a consumer's worker side and pulls ``N`` blocks of one request, for
several ``N``, ``--repeats`` times each, exactly as the engine drives the connector (step metadata with the holds and
the pulls, ``start_load_kv``, ``get_finished`` polled until the pull is reported). The time is from handing the pull
to the connector to its report (the connect, the request, the transfer and the receive into the destination blocks);
GB/s = bytes / seconds / 1e9. The pulled blocks are checked bitwise against the producer's (a per-block checksum of
the bytes). No model runs: the transfer path is the connector's whole cost, the engines around it add only their
step loop (the polling interval of ``get_finished``). The goal is >= 1 GB/s on one host.

Usage: ``python -m experiments.engine.bench_kv_transfer [--block-counts 1,16,64,256] [--repeats 5]``
(``--num-layers 2 --block-counts 1,4 --repeats 1`` is a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

from experiments.common import code_state, machine_info, markdown_table


def _backend(args: argparse.Namespace) -> Any:
    import torch

    from plugins.attention.torch_paged import TorchPagedAttentionBackend

    return TorchPagedAttentionBackend(num_heads=args.num_kv_heads, num_kv_heads=args.num_kv_heads,
                                      head_size=args.head_size, scale=args.head_size ** -0.5,
                                      block_size=args.block_size, dtype=getattr(torch, args.dtype),
                                      device=torch.device("cpu"))


def _caches(args: argparse.Namespace, num_blocks: int, seed: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    shape = _backend(args).get_kv_cache_shape(num_blocks)
    return [torch.randn(shape, generator=gen).to(getattr(torch, args.dtype)) for _ in range(args.num_layers)]


def _checksums(caches: list[Any], blocks: list[int]) -> list[int]:
    """One integer per block: the sum of its bytes over every layer (a cheap bitwise check; layout
    ``(2, num_blocks, ...)``)."""
    import torch

    return [sum(int(c[:, b].contiguous().view(-1).view(torch.uint8).sum()) for c in caches) for b in blocks]


def _worker(role: str, args: argparse.Namespace, caches: list[Any]) -> Any:
    from framework.interfaces import KVConnectorRole
    from plugins.kv_connectors.zmq import ZmqConnector

    connector = ZmqConnector(KVConnectorRole.WORKER, args.block_size, kv_role=role, host=args.host,
                             pull_timeout_s=60.0)
    connector.register_kv_caches(caches, _backend(args))
    return connector


def _drive(connector: Any, meta: Any) -> tuple[set[str], set[str]]:
    """One step of the worker side: bind, start, report."""
    connector.bind_connector_metadata(meta)
    connector.start_load_kv()
    sending, recving = connector.get_finished(set())
    connector.clear_connector_metadata()
    return sending or set(), recving or set()


def producer(conn: Any, args: argparse.Namespace, num_blocks: int) -> None:
    """The producer process: holds what the parent asks, reports the endpoint, checksums and finished sends."""
    from plugins.kv_connectors.zmq import ZmqMetadata

    caches = _caches(args, num_blocks, seed=0)
    connector = _worker("kv_producer", args, caches)
    _, _, _, host, port = connector.get_kv_connector_kv_cache_events()[0]  # (event, engine id, rank, host, port)
    conn.send((host, port))
    while (msg := conn.recv()) is not None:
        rid, blocks = msg
        _drive(connector, ZmqMetadata(holds={rid: blocks}))
        conn.send(_checksums(caches, blocks))
        while rid not in _drive(connector, ZmqMetadata())[0]:
            time.sleep(0.0005)
        conn.send("freed")
    connector.close()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Pull each block count ``args.repeats`` times; one result row per count."""
    from plugins.kv_connectors._zmq_wire import Pull
    from plugins.kv_connectors.zmq import ZmqMetadata

    counts = [int(n) for n in args.block_counts.split(",")]
    num_blocks = max(counts)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=producer, args=(child, args, num_blocks))
    proc.start()
    try:
        host, port = parent.recv()
        caches = _caches(args, num_blocks, seed=1)
        consumer = _worker("kv_consumer", args, caches)
        rows = []
        for n in counts:
            seconds, num_bytes = [], 0
            for rep in range(args.repeats):
                rid, blocks = f"r{n}-{rep}", list(range(n))
                parent.send((rid, blocks))
                want = parent.recv()
                start = time.perf_counter()
                done = _drive(consumer, ZmqMetadata(pulls=[Pull(rid, rid, host, port, blocks, blocks)]))[1]
                while rid not in done:
                    time.sleep(0.0002)
                    done = _drive(consumer, ZmqMetadata())[1]
                seconds.append(time.perf_counter() - start)
                stats = consumer.get_kv_connector_stats()
                assert consumer.get_block_ids_with_load_errors() == set() and stats, f"pull {rid} failed"
                num_bytes = stats[0][0]
                assert _checksums(caches, blocks) == want, f"pull {rid}: blocks differ from the producer's"
                assert parent.recv() == "freed"
            best, median = min(seconds), statistics.median(seconds)
            rows.append({"blocks": n, "bytes": num_bytes, "median_ms": median * 1e3, "best_ms": best * 1e3,
                         "median_gb_per_s": num_bytes / median / 1e9, "best_gb_per_s": num_bytes / best / 1e9})
        consumer.close()
        return rows
    finally:
        parent.send(None)
        proc.join(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-counts", default="1,16,64,256", help="blocks per pull, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--json", help="also write the rows, the machine and the code state to this file")
    args = p.parse_args()
    info = {"machine": machine_info(), "code": code_state(), "args": vars(args)}
    print(f"CPU: {info['machine']['isa']}, {info['machine']['num_cpus']} CPUs")
    rows = run(args)
    print(markdown_table(["blocks", "MiB", "median ms", "best ms", "median GB/s", "best GB/s"],
                         [[r["blocks"], f"{r['bytes'] / 2**20:.2f}", f"{r['median_ms']:.2f}", f"{r['best_ms']:.2f}",
                           f"{r['median_gb_per_s']:.2f}", f"{r['best_gb_per_s']:.2f}"] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
