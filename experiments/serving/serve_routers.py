"""Routers on a real model, served (issue 49): 2 replicas x 1 CPU against 1 engine x 2 CPUs, every router.

For each cell ``servelab serve`` starts (SmolLM2 by default; the engine cores in their own processes,
``parallel.data_parallel_size=2 router=R`` pins each replica to one CPU; the ``1x2`` baseline is one engine on both
CPUs), ``experiments/serving/bench_serving.py`` replays the workload (``shared_prefix`` or ``multi_turn`` with their
arrival times), then the server's ``/metrics`` gives the prefix-cache hit rate (hit / queried prompt tokens over
the replicas) and each replica's routed requests. Measured, on this machine's CPUs, with nothing else running.

    .venv/bin/python -m experiments.serving.serve_routers --out docs/results/parallel/serve_routers.json
    .venv/bin/python -m experiments.serving.serve_routers --routers round_robin,cache_aware --workloads shared_prefix
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT
from experiments.serving.serve_vs_vllm import stop_server
from experiments.serving.time_to_healthy import poll_health

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROUTERS = "round_robin,random,power_of_two,least_loaded,cache_aware,prefix_score"
WORKLOADS = {  # small enough for 2 CPUs; prefixes not a multiple of 2 so round_robin gets no affinity by luck
    "shared_prefix": ["workload.num_prefixes=5", "workload.questions_per_prefix=8", "workload.prefix_len=256",
                      "workload.question_len=32", "workload.output_len=32", "workload.request_rate=4"],
    "multi_turn": ["workload.num_conversations=8", "workload.turns=4", "workload.first_len=192",
                   "workload.turn_len=32", "workload.output_len=32", "workload.turn_gap_s=1.0",
                   "workload.request_rate=2"],
}


def scrape(base: str) -> dict[str, float]:
    """``/metrics`` samples as ``name{labels}`` -> value."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(servelab:[^ ]+) ([0-9.e+-]+)$", text, re.M)}


def cell(args: argparse.Namespace, layout: str, router: str | None, workload: str, workdir: Path) -> dict[str, Any]:
    """One server start, one benchmark, its numbers."""
    port = 8800 + hash((layout, router, workload)) % 800
    overrides = [f"model={args.model}", f"server.port={port}", "server.served_model_name=bench-model",
                 "tracker=none", "server.log_level=warning"]
    if layout == "2x1":
        overrides += ["parallel.data_parallel_size=2", f"router={router}"]
    name = f"{layout}_{router or 'single'}_{workload}"
    log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(REPO_ROOT / ".venv" / "bin" / "servelab"), "serve", *overrides], stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        health = poll_health(base + "/health", proc, time.perf_counter(), 600)
        if health["healthy_s"] is None:
            raise RuntimeError(f"{name}: never healthy ({health}); see {workdir / name}.log")
        before = scrape(base)
        result_file = workdir / f"{name}.json"
        subprocess.run([sys.executable, "-m", "experiments.serving.bench_serving", "--base-url", base,
                        "--model", "bench-model", "--tokenizer", args.model, "--workload", workload,
                        *WORKLOADS[workload], "--ignore-eos", "--result-file", str(result_file)],
                       check=True, capture_output=True, timeout=900, cwd=REPO_ROOT)
        after = scrape(base)
        bench = json.loads(result_file.read_text())
    finally:
        stop_server(proc, log)

    def delta(key: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0] == key)

    queries, hits = delta("servelab:prefix_cache_queries_total"), delta("servelab:prefix_cache_hits_total")
    routed = [v for k, v in sorted(after.items()) if k.startswith("servelab:replica_num_requests_routed")]
    return {"layout": layout, "router": router, "workload": workload,
            "prefix_hit_rate": hits / queries if queries else 0.0, "routed_per_replica": routed,
            **{k: bench.get(k) for k in ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                         "median_itl_ms", "p99_itl_ms")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--routers", default=ROUTERS)
    p.add_argument("--workloads", default="shared_prefix,multi_turn")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from framework.platform import cpu_name

    workdir = Path(tempfile.mkdtemp(prefix="serve-routers-"))
    rows = []
    for workload in args.workloads.split(","):
        cells = [("1x2", None)] + [("2x1", r) for r in args.routers.split(",")]
        for layout, router in cells:
            row = cell(args, layout, router, workload, workdir)
            rows.append(row)
            print(f"{workload:13s} {layout} {router or '-':13s} hit {row['prefix_hit_rate']:.3f}  "
                  f"{row['output_throughput']:.1f} tok/s  TTFT p50 {row['median_ttft_ms']:.0f} / p99 "
                  f"{row['p99_ttft_ms']:.0f} ms  routed {row['routed_per_replica']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"cpu": cpu_name(), "model": args.model, "workloads": WORKLOADS,
                                              "rows": rows}, indent=2) + "\n")
    print(f"logs: {workdir}")


if __name__ == "__main__":
    main()
