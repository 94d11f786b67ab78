"""Many LoRA adapters through ``executor=sim``: throughput and TTFT against the number of distinct adapters and their
rank, ``scheduler=fcfs`` vs ``scheduler=lora_affinity`` (an S-LoRA-style study, Sheng et al., MLSys 2024, Sec. 7).

Llama-3-70B (shapes only) tensor-parallel 8 on an analytic H100; ``--num-requests`` Poisson arrivals at ``--rate``
req/s, each naming an adapter drawn uniformly from ``N`` adapters of rank ``r`` on q/k/v/o (PEFT
``adapter_config.json`` files written to a temporary folder: the simulator reads only the configs), ``max_loras``
device slots, every adapter in the CPU cache. Adapter loads (host link) and the shrink/expand FLOPs come from
``framework/sim/lora_cost.py``; the base model's step from the roofline. Every number is analytic, not a
measurement.

    python -m experiments.sim.sim_lora --adapters 1,16 --ranks 8 --num-requests 200              # quick
    python -m experiments.sim.sim_lora --json-out docs/results/lora/sim_lora.json --plot docs/results/lora/sim_lora.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
from pathlib import Path
from typing import Any

from experiments.common import code_state, markdown_table, save_figure
from experiments.sim.sim_disagg import LLAMA_70B, _pct

SCHEDULERS = ("fcfs", "lora_affinity")


def write_adapters(root: Path, num_adapters: int, rank: int) -> dict[str, str]:
    """``num_adapters`` adapter folders of rank ``rank`` on q/k/v/o (configs only); name -> folder."""
    modules = {}
    for i in range(num_adapters):
        folder = root / f"r{rank}" / f"lora{i:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(
            {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
        modules[folder.name] = str(folder)
    return modules


def popularity(spec: str, num_adapters: int) -> list[float]:
    """Each adapter's weight in the draw: ``uniform``, or ``zipf:<alpha>`` (adapter ``i`` ~ ``1 / (i + 1)^alpha``,
    S-LoRA Sec. 7's power-law popularity).

    Raises:
        ValueError: another spec.
    """
    if spec == "uniform":
        return [1.0] * num_adapters
    if spec.startswith("zipf:"):
        alpha = float(spec.removeprefix("zipf:"))
        return [1.0 / (i + 1) ** alpha for i in range(num_adapters)]
    raise ValueError(f"--popularity must be uniform or zipf:<alpha>, got {spec!r}")


def run(args: argparse.Namespace, root: Path, num_adapters: int, rank: int, scheduler: str | None) -> dict[str, Any]:
    """One simulated run (``scheduler=None``: the base model, no adapters): throughput, TTFT and adapter loads."""
    from framework import build_engine
    from framework.config import EngineConfig
    from framework.core.sampling_params import SamplingParams
    from framework.entrypoints.offline_runner import run_workload
    from framework.workloads.item import WorkloadItem

    lora = scheduler is not None
    modules = write_adapters(root, num_adapters, rank) if lora else {}
    config = EngineConfig(model=LLAMA_70B, tokenizer="smollm2", dtype="bfloat16", compile=False, executor="sim",
                          executor_params={"profile": f"analytic:{args.device}"}, tensor_parallel_size=args.tp,
                          max_model_len=4096, max_num_seqs=args.max_num_seqs, scheduler=scheduler or "fcfs",
                          scheduler_params={"aging_s": args.aging_s} if scheduler == "lora_affinity" else {},
                          enable_lora=lora, max_loras=args.max_loras, max_lora_rank=max(8, rank),
                          max_cpu_loras=max(num_adapters, args.max_loras), lora_modules=modules)
    rng = random.Random(args.seed)
    names, t, items = sorted(modules), 0.0, []
    weights = popularity(args.popularity, num_adapters if lora else 1)
    for i in range(args.num_requests):  # the same draws with and without adapters: every run sees one trace
        t += rng.expovariate(args.rate)
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(args.input_len // 2, args.input_len * 3 // 2))]
        adapter = rng.choices(range(len(weights)), weights)[0]
        items.append(WorkloadItem(f"r{i}", prompt_token_ids=prompt, lora=names[adapter] if lora else None,
                                  max_tokens=rng.randint(args.output_len // 2, args.output_len * 3 // 2),
                                  arrival_time_s=t))
    engine = build_engine(config)
    try:
        records, summary = run_workload(engine, items, SamplingParams(temperature=0.0, ignore_eos=True),
                                        progress=False)
        cost = engine.executor.lora_cost
    finally:
        engine.shutdown()
    ttfts = [r["metrics"]["ttft_s"] * 1e3 for r in records]
    row = {"scheduler": scheduler or "base", "adapters": num_adapters if lora else 0, "rank": rank if lora else 0,
           "output_throughput": summary["output_throughput"], "ttft_p50_ms": _pct(ttfts, 0.5),
           "ttft_p99_ms": _pct(ttfts, 0.99), "duration_s": summary["duration_s"],
           "popularity": args.popularity, "adapter_loads": cost.num_loads if cost is not None else 0,
           "errors": sum(1 for r in records if r.get("error"))}
    print(f"{row['scheduler']:>13} N={num_adapters:<4} r={rank:<2}: {row['output_throughput']:7.0f} tok/s, TTFT p50 "
          f"{row['ttft_p50_ms']:7.0f} ms p99 {row['ttft_p99_ms']:7.0f} ms, {row['adapter_loads']} loads", flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per run, the base model's first."""
    return markdown_table(["scheduler", "adapters", "rank", "output tok/s", "x base", "TTFT p50 ms", "TTFT p99 ms",
                           "adapter loads"],
                          [[r["scheduler"], r["adapters"], r["rank"], f"{r['output_throughput']:.0f}",
                            f"{r['output_throughput'] / rows[0]['output_throughput']:.2f}", f"{r['ttft_p50_ms']:.0f}",
                            f"{r['ttft_p99_ms']:.0f}", r["adapter_loads"]] for r in rows])


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    """Throughput and TTFT p99 against distinct adapters (log x), one line per (scheduler, rank)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    base = rows[0]
    for key in dict.fromkeys((r["scheduler"], r["rank"]) for r in rows[1:]):
        mine = [r for r in rows[1:] if (r["scheduler"], r["rank"]) == key]
        label = f"{key[0]}, rank {key[1]}"
        left.plot([r["adapters"] for r in mine], [r["output_throughput"] for r in mine], marker="o", label=label)
        right.plot([r["adapters"] for r in mine], [r["ttft_p99_ms"] for r in mine], marker="o", label=label)
    left.axhline(base["output_throughput"], color="grey", linestyle=":", label="base model")
    right.axhline(base["ttft_p99_ms"], color="grey", linestyle=":")
    left.set(xscale="log", xlabel="distinct adapters", ylabel="output tokens/s", title="throughput")
    right.set(xscale="log", yscale="log", xlabel="distinct adapters", ylabel="TTFT p99, ms", title="TTFT p99")
    left.legend(fontsize=8)
    fig.suptitle(f"Llama-3-70B TP={args.tp}, analytic {args.device.upper()}, max_loras={args.max_loras}, "
                 f"{args.rate:g} req/s (simulated)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """The base model, then every (rank, adapters, scheduler); print (and optionally write) table, JSON, plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", default="1,4,16,64,1000", help="distinct adapters per run")
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0, help="offered Poisson rate, req/s")
    parser.add_argument("--input-len", type=int, default=512, help="mean prompt tokens (uniform 0.5x-1.5x)")
    parser.add_argument("--output-len", type=int, default=128, help="mean output tokens (uniform 0.5x-1.5x)")
    parser.add_argument("--popularity", default="uniform", help="uniform | zipf:<alpha> (adapter draw)")
    parser.add_argument("--aging-s", type=float, default=10.0, help="lora_affinity's starvation bound, seconds")
    parser.add_argument("--max-loras", type=int, default=8, help="device slots (vLLM's max_loras)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--device", default="h100")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="sim-lora-") as tmp:
        rows = [run(args, Path(tmp), 0, 0, None)]
        rows += [run(args, Path(tmp), int(n), int(r), s) for r in args.ranks.split(",")
                 for s in args.schedulers.split(",") for n in args.adapters.split(",")]
    print(table(rows))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        report = {"args": vars(args), "code": code_state(), "rows": rows}  # code: the commit the numbers are from
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(rows, args, args.plot)
    return rows


if __name__ == "__main__":
    main()
