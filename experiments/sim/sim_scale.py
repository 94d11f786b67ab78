"""``executor=sim`` at a scale this machine cannot hold: 10,000 requests of a shared-prefix trace on Llama-3-70B
(shapes only, ``models/llama-3-70b``), tensor parallel 8, an analytic H100 profile, the virtual clock; then the
real scheduler policies x KV allocators on that trace (every number here is analytic: a roofline of published
H100 figures, not a measurement).

    python -m experiments.sim.sim_scale --schedulers fcfs --allocators paged           # the 10,000-request run, timed
    python -m experiments.sim.sim_scale --json-out docs/results/sim/scale.json --plot-dir docs/results/sim   # ablation
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from experiments.common import markdown_table
from experiments.sim._composed_run import run_composed

COLUMNS = {"TTFT p50 ms": "median_ttft_ms", "TTFT p99 ms": "p99_ttft_ms", "TPOT mean ms": "mean_tpot_ms",
           "e2e p50 s": "median_e2el_ms", "out tok/s": "output_throughput", "prefix hit rate": "prefix_cache_hit_rate",
           "preemptions": "num_preemptions", "peak running": "peak_num_running_reqs",
           "fragmentation": "mean_kv_cache_fragmentation"}


def overrides(args: argparse.Namespace, scheduler: str, allocator: str) -> list[str]:
    """The run config of one cell of the ablation."""
    per_prefix = args.num_requests // args.num_prefixes
    return ["model=llama3_70b", "executor=sim", f"executor.params.profile=analytic:{args.device}",
            f"executor.params.gpu_memory_utilization={args.gpu_memory_utilization}",
            f"parallel.tensor_parallel_size={args.tp}", f"engine.max_model_len={args.max_model_len}",
            f"engine.max_num_seqs={args.max_num_seqs}", "engine.compile=false", f"scheduler={scheduler}",
            f"kv_cache={allocator}", "workload=shared_prefix", f"workload.num_prefixes={args.num_prefixes}",
            f"workload.questions_per_prefix={per_prefix}", f"workload.prefix_len={args.prefix_len}",
            f"workload.question_len={args.question_len}", f"workload.output_len={args.output_len}",
            f"workload.request_rate={args.request_rate}", "sampling.ignore_eos=true", "tracker=none", "ui=none"]


def run(args: argparse.Namespace, scheduler: str, allocator: str) -> dict[str, Any]:
    """One simulated run; its summary, wall seconds and the timeline of KV usage and running requests."""
    res = run_composed(overrides(args, scheduler, allocator))
    summary, timeline, wall, num_requests = res.summary, res.timeline, res.wall_s, res.num_requests
    print(f"{scheduler:>8} x {allocator:<10} {num_requests} requests: wall {wall:.1f} s, simulated {summary['duration_s']:.0f} s, "
          f"{summary['num_steps']} steps, TTFT p50 {summary['median_ttft_ms']:.0f} ms, TPOT {summary['mean_tpot_ms']:.1f} ms, "
          f"hit rate {summary['prefix_cache_hit_rate']:.3f}, preemptions {summary['num_preemptions']}", flush=True)
    return {"scheduler": scheduler, "kv_cache": allocator, "wall_s": wall, "num_requests": num_requests,
            "summary": summary, "timeline": timeline[:: max(1, len(timeline) // 400)]}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per (scheduler, allocator)."""
    return markdown_table(["scheduler", "kv_cache", *COLUMNS, "wall s"], [
        [r["scheduler"], r["kv_cache"], *(_cell(name, r["summary"].get(key)) for name, key in COLUMNS.items()),
         f"{r['wall_s']:.0f}"]
        for r in rows])


def _cell(column: str, value: Any) -> str:
    """A summary value as :func:`table` shows it: ms as s in an ``... s`` column; floats under 1 to 3 decimals."""
    value = value / 1000 if column.endswith(" s") and value is not None else value
    return ("-" if value is None else f"{value:.3f}" if isinstance(value, float) and value < 1 else
            f"{value:.1f}" if isinstance(value, float) else str(value))


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Bars of TTFT p50/p99 and TPOT per configuration, and KV usage over simulated time (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [f"{r['scheduler']}\n{r['kv_cache']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (title, key, scale) in zip(axes, (("TTFT p50 / p99 (s)", ("median_ttft_ms", "p99_ttft_ms"), 1e-3),
                                              ("TPOT mean (ms)", ("mean_tpot_ms",), 1.0),
                                              ("prefix-cache hit rate", ("prefix_cache_hit_rate",), 1.0))):
        width = 0.8 / len(key)
        for j, k in enumerate(key):
            ax.bar([i + j * width for i in range(len(rows))], [(r["summary"].get(k) or 0) * scale for r in rows],
                   width, label=k)
        ax.set_xticks([i + width * (len(key) - 1) / 2 for i in range(len(rows))], labels, fontsize=7)
        ax.set_title(title + " [analytic H100]")
        if len(key) > 1:
            ax.legend(fontsize=7)
    fig.tight_layout()
    bars = out_dir / "sim_scale_ablation.png"
    fig.savefig(bars, dpi=110)
    fig, ax = plt.subplots(figsize=(8, 4))
    for r, label in zip(rows, labels):
        ax.plot([p["time_s"] for p in r["timeline"]], [p["kv_cache_usage"] for p in r["timeline"]],
                label=label.replace("\n", " x "), lw=1)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("KV cache usage")
    ax.set_title("KV usage over the run [analytic H100, Llama-3-70B TP=8]")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    usage = out_dir / "sim_scale_kv_usage.png"
    fig.savefig(usage, dpi=110)
    return [bars, usage]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the ablation; print (and optionally write) the table, JSON and plots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--num-prefixes", type=int, default=50)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=60.0, help="Poisson arrivals, req/s")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--schedulers", default="fcfs,lpm,sjf")
    parser.add_argument("--allocators", default="paged,radix,contiguous")
    parser.add_argument("--json-out")
    parser.add_argument("--plot-dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = [run(args, s, a) for s in args.schedulers.split(",") for a in args.allocators.split(",")]
    print(table(rows))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    if args.plot_dir:
        for path in plot(rows, Path(args.plot_dir)):
            print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
