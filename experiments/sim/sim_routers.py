"""Routers at scale through ``executor=sim``: 8-64 data-parallel replicas of Llama-3-70B (shapes only), each
tensor-parallel 8 on an analytic H100 profile, the virtual clock; every router on the ``shared_prefix`` and
``multi_turn`` workloads: prefix-cache hit rate, TTFT p50/p99, output throughput and per-replica load (every
number is analytic: a roofline of published H100 figures, not a measurement).

    python -m experiments.sim.sim_routers --replicas 8 --workloads shared_prefix       # one size, quick
    python -m experiments.sim.sim_routers --json-out docs/results/sim/routers.json     # the whole grid
    python -m experiments.sim.sim_routers --replicas 2 --requests-per-replica 2 --model stories260K --tp 1 \
        --max-model-len 256 --prefix-len 64 --turn-len 16 --output-len 4 -- engine.num_blocks=256  # smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from experiments.common import markdown_table
from experiments.sim._composed_run import run_composed

ROUTERS = "round_robin,random,power_of_two,least_loaded,cache_aware,prefix_score"
COLUMNS = {"hit rate": "prefix_cache_hit_rate", "TTFT p50 ms": "median_ttft_ms", "TTFT p99 ms": "p99_ttft_ms",
           "out tok/s": "output_throughput", "load max/mean": "load_imbalance"}


def workload_overrides(args: argparse.Namespace, workload: str, replicas: int) -> list[str]:
    """The workload of one cell: ``requests_per_replica * replicas`` requests at ``rate_per_replica * replicas``."""
    n = args.requests_per_replica * replicas
    rate = f"workload.request_rate={args.rate_per_replica * replicas}"
    if workload == "shared_prefix":
        # one more prefix than a multiple of the replica count: the workload interleaves its prefixes in a fixed
        # cycle, and a cycle as long as a multiple of the replicas would hand round_robin perfect prefix affinity
        prefixes = args.prefixes_per_replica * replicas + 1
        return ["workload=shared_prefix", f"workload.num_prefixes={prefixes}",
                f"workload.questions_per_prefix={max(1, n // prefixes)}", f"workload.prefix_len={args.prefix_len}",
                f"workload.question_len={args.turn_len}", f"workload.output_len={args.output_len}", rate]
    return ["workload=multi_turn", f"workload.num_conversations={max(1, n // args.turns)}",
            f"workload.turns={args.turns}", f"workload.first_len={args.prefix_len}", f"workload.turn_len={args.turn_len}",
            f"workload.output_len={args.output_len}", "workload.turn_gap_s=2.0", rate]


def run(args: argparse.Namespace, workload: str, replicas: int, router: str) -> dict[str, Any]:
    """One simulated run of ``replicas`` replicas behind ``router``: its summary and wall seconds."""
    res = run_composed([f"model={args.model}", "executor=sim", f"executor.params.profile=analytic:{args.device}",
                        f"parallel.tensor_parallel_size={args.tp}", f"parallel.data_parallel_size={replicas}",
                        f"router={router}", f"engine.max_model_len={args.max_model_len}", "engine.compile=false",
                        "sampling.ignore_eos=true", "tracker=none", "ui=none",
                        *workload_overrides(args, workload, replicas), *args.overrides])
    summary, wall, num_requests = res.summary, res.wall_s, res.num_requests
    print(f"{workload:>13} x{replicas:<3} {router:<13} {num_requests} requests: wall {wall:.1f} s, hit rate "
          f"{summary['prefix_cache_hit_rate']:.3f}, TTFT p50 {summary['median_ttft_ms']:.0f} ms p99 "
          f"{summary['p99_ttft_ms']:.0f} ms, {summary['output_throughput']:.0f} tok/s, "
          f"load max/mean {summary['load_imbalance']:.2f}", flush=True)
    return {"workload": workload, "replicas": replicas, "router": router, "wall_s": wall,
            "num_requests": num_requests, "summary": summary}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per (workload, replicas, router)."""
    def cell(key: str, value: float) -> str:
        return f"{value:.3f}" if key in ("prefix_cache_hit_rate", "load_imbalance") else f"{value:.0f}"

    return markdown_table(["workload", "replicas", "router", *COLUMNS],
                          [[r["workload"], r["replicas"], r["router"], *(cell(k, r["summary"][k]) for k in COLUMNS.values())]
                           for r in rows])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid; print (and optionally write) the table and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="8,16,32,64")
    parser.add_argument("--routers", default=ROUTERS)
    parser.add_argument("--workloads", default="shared_prefix,multi_turn")
    parser.add_argument("--requests-per-replica", type=int, default=32)
    parser.add_argument("--rate-per-replica", type=float, default=4.0, help="Poisson arrivals per replica, req/s")
    parser.add_argument("--prefixes-per-replica", type=int, default=2, help="shared_prefix: system prompts (x replicas, + 1)")
    parser.add_argument("--turns", type=int, default=4, help="multi_turn: turns per conversation")
    parser.add_argument("--prefix-len", type=int, default=1024,
                        help="tokens of a shared_prefix system prompt and of a multi_turn first turn")
    parser.add_argument("--turn-len", type=int, default=128, help="tokens of a question / of a later turn")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--model", default="llama3_70b", help="a conf/model option whose shapes are simulated "
                        "(stories260K with --tp 1 --max-model-len 256: a seconds-long smoke run)")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--json-out")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1:]  # more Hydra overrides for every run (keys the script does not set)
    logging.basicConfig(level=logging.WARNING)
    rows = [run(args, w, int(n), r) for w in args.workloads.split(",") for n in args.replicas.split(",")
            for r in args.routers.split(",")]
    print(table(rows))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        for row in rows:  # per-replica detail stays, the timeline is dropped
            row["summary"].pop("spec_acceptance_by_position", None)
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
