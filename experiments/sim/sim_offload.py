"""KV offload on/off at a thrashing KV budget, through ``executor=sim``: a multi-turn chat workload (every turn
re-sends the conversation so far) on Llama-3-70B (shapes only) tensor-parallel 8 on an analytic H100, its paged KV
cache cut to ``--num-blocks`` blocks so the local prefix cache loses earlier turns; arm ``recompute``
(``kv_connector=none``) recomputes them, arm ``offload`` (``kv_connector=offload``, a CPU tier of ``--cpu-gib`` GiB
per rank) loads them back over ``--cpu-bandwidth-gbps`` (``plugins/executors/_sim_offload.py``; LMCache's CPU
backend, vLLM's ``OffloadingConnector``). The tiers' hits are the real connector's scheduler side and LRU; step
times and load times are analytic (a roofline of published H100 figures and a PCIe figure), not measurements.
``--layouts`` repeats both arms behind data-parallel fronts: ``2`` colocated replicas, or ``1p1d`` P/D (one prefill
and one decode replica; the tiers on the prefill replica, as LMCache's P/D set-up).

    python -m experiments.sim.sim_offload --conversations 8                      # quick
    python -m experiments.sim.sim_offload --json-out results/sim_offload.json
    python -m experiments.sim.sim_offload --layouts 2,1p1d --num-blocks 320          # offload in P/D
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from experiments.common import markdown_table
from experiments.sim.sim_disagg import LLAMA_70B, _pct


def run_arm(offload: bool, num_blocks: int, conversations: int = 16, turns: int = 4, first_len: int = 1024,
            turn_len: int = 128, output_len: int = 64, turn_gap_s: float = 1.0, cpu_gib: float = 64.0,
            cpu_bandwidth_gbps: float = 400.0, device: str = "h100", tp: int = 8, seed: int = 0,
            max_model_len: int = 4096, replicas: int = 1, prefill_replicas: int = 0) -> dict[str, Any]:
    """One simulated run of the multi-turn workload; its hit counts, TTFT percentiles (seconds) and throughput.
    ``replicas > 1``: a data-parallel front, colocated (``prefill_replicas=0``) or P/D with ``prefill_replicas``
    prefill replicas (the offload tiers then sit on the prefill replicas: docs/simulator.md)."""
    from framework import build_engine
    from framework.config import EngineConfig
    from framework.core.sampling_params import SamplingParams
    from framework.entrypoints.offline_runner import run_workload
    from framework.workloads.synthetic import multi_turn_workload

    config = EngineConfig(
        model=LLAMA_70B, tokenizer="smollm2", dtype="bfloat16", compile=False, tensor_parallel_size=tp,
        executor="sim", executor_params={"profile": f"analytic:{device}", "offload_cpu_bandwidth_gbps": cpu_bandwidth_gbps},
        num_blocks=num_blocks, max_model_len=max_model_len, kv_connector="offload" if offload else "none",
        kv_connector_params={"cpu_bytes": int(cpu_gib * (1 << 30))} if offload else {},
        data_parallel_size=replicas, disagg_prefill_replicas=prefill_replicas)
    engine = build_engine(config)
    items = multi_turn_workload(conversations, turns, first_len, turn_len, output_len, turn_gap_s, seed, 30000)
    try:
        records, summary = run_workload(engine, items, SamplingParams(temperature=0.0, ignore_eos=True),
                                        progress=False)
        ranks = [r.executor for r in _replicas(engine)]
        sims = [x.offload for x in ranks if x.offload is not None]
        ttfts = [r["metrics"]["ttft_s"] for r in records]
        layout = "one replica" if replicas == 1 else (f"{prefill_replicas}P+{replicas - prefill_replicas}D"
                                                       if prefill_replicas else f"{replicas} colocated")
        return {"arm": "offload" if offload else "recompute", "layout": layout, "num_blocks": num_blocks,
                "num_requests": len(records),
                "external_prefix_cache_queries": summary["external_prefix_cache_queries"],
                "external_prefix_cache_hits": summary["external_prefix_cache_hits"],
                "prefix_cache_hit_rate": summary["prefix_cache_hit_rate"],
                "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
                "output_throughput": summary["output_throughput"], "num_preemptions": summary["num_preemptions"],
                "block_bytes": ranks[0].rank.kv_cache_bytes_per_block(),
                "offload_load_bytes": sum(sum(sim.load_bytes.values()) for sim in sims),
                "offload_save_bytes": sum(sim.save_bytes for sim in sims), "num_steps": summary["num_steps"],
                "replicas": summary.get("replicas", [])}
    finally:
        engine.shutdown()


def _replicas(engine: Any) -> list[Any]:
    """The replica engines behind ``engine``: itself, a data-parallel front's replicas, or both P/D pools'."""
    if hasattr(engine, "all_replicas"):
        return engine.all_replicas()
    return list(getattr(engine, "replicas", [engine]))


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per arm."""
    return markdown_table(
        ["layout", "arm", "KV blocks", "external hits (tokens)", "local hit rate", "TTFT p50 ms", "TTFT p99 ms", "output tok/s",
         "loaded GiB per rank"],
        [[r["layout"], r["arm"], r["num_blocks"], f"{r['external_prefix_cache_hits']} / {r['external_prefix_cache_queries']}",
          f"{r['prefix_cache_hit_rate']:.2f}", f"{1e3 * r['ttft_p50_s']:.1f}", f"{1e3 * r['ttft_p99_s']:.1f}",
          f"{r['output_throughput']:.0f}", f"{r['offload_load_bytes'] / (1 << 30):.2f}"] for r in rows])


def _layout(text: str) -> dict[str, int]:
    """``--layouts`` item -> ``run_arm``'s ``replicas`` and ``prefill_replicas`` (``2``: two colocated; ``1p1d``).

    Raises:
        ValueError: neither a count nor ``<P>p<D>d``.
    """
    text = text.strip().lower()
    if text.isdigit():
        return {"replicas": int(text), "prefill_replicas": 0}
    p, _, d = text.removesuffix("d").partition("p")
    if not (p.isdigit() and d.isdigit()):
        raise ValueError(f"--layouts item {text!r}: a replica count (2) or <P>p<D>d (1p1d)")
    return {"replicas": int(p) + int(d), "prefill_replicas": int(p)}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Both arms at each KV budget; print (and optionally write) the table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", default="320,1280", help="KV budgets per rank, blocks of 16 tokens")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=1024, help="tokens of each conversation's first message")
    parser.add_argument("--turn-len", type=int, default=128, help="tokens of each later message")
    parser.add_argument("--output-len", type=int, default=64, help="tokens of each answer")
    parser.add_argument("--turn-gap-s", type=float, default=1.0)
    parser.add_argument("--cpu-gib", type=float, default=64.0, help="the CPU tier per rank, GiB")
    parser.add_argument("--cpu-bandwidth-gbps", type=float, default=400.0, help="CPU tier <-> GPU, Gbit/s per rank")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--layouts", default="1",
                        help="comma list of replica layouts: 1 (one replica), N (N colocated), PpDd (P prefill + D "
                             "decode replicas, e.g. 1p1d)")
    parser.add_argument("--json-out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    knobs = dict(conversations=args.conversations, turns=args.turns, first_len=args.first_len,
                 turn_len=args.turn_len, output_len=args.output_len, turn_gap_s=args.turn_gap_s,
                 cpu_gib=args.cpu_gib, cpu_bandwidth_gbps=args.cpu_bandwidth_gbps, device=args.device, tp=args.tp)
    rows = [run_arm(offload, int(n), **knobs, **_layout(layout)) for layout in args.layouts.split(",")
            for n in args.num_blocks.split(",") for offload in (False, True)]
    print(table(rows))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
