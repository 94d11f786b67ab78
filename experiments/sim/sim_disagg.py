"""Goodput against request rate, colocated vs P/D disaggregated, through ``executor=sim`` (a DistServe-style study,
Zhong et al., OSDI'24, Sec. 6): Llama-3-70B (shapes only) tensor-parallel 8 on analytic H100s, ``replicas`` replicas
either all colocated (chunked prefill mixes prefills into decode steps) or ``prefill`` of them prefilling and the
rest decoding, the K/V moving over ``--bandwidth-gbps``. A request meets its SLO when TTFT <= ``--slo-ttft-ms`` and
TPOT <= ``--slo-tpot-ms``; goodput is the rate of requests that do, and a configuration's capacity is the highest
offered rate at which ``--attainment`` of its requests do (DistServe's definition). Every number is analytic: a
roofline of published H100 figures, not a measurement.

    python -m experiments.sim.sim_disagg --rates 2,4 --num-requests 60                # quick
    python -m experiments.sim.sim_disagg --json-out docs/results/sim/disagg.json --plot docs/results/sim/disagg.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Any

from experiments.common import markdown_table, save_figure

REPO = Path(__file__).resolve().parents[2]
LLAMA_70B = str(REPO / "models" / "llama-3-70b")


def trace(args: argparse.Namespace, rate: float) -> list[Any]:
    """``num_requests`` Poisson arrivals at ``rate`` req/s, prompt and output lengths uniform in their ranges
    (seeded: every configuration sees the same requests at one rate)."""
    from framework.workloads.item import WorkloadItem

    rng = random.Random(args.seed)
    t, items = 0.0, []
    for i in range(args.num_requests):
        t += rng.expovariate(rate)
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(args.input_len // 2, args.input_len * 3 // 2))]
        items.append(WorkloadItem(f"r{i}", prompt_token_ids=prompt,
                                  max_tokens=rng.randint(args.output_len // 2, args.output_len * 3 // 2),
                                  arrival_time_s=t))
    return items


def engine_config(args: argparse.Namespace, prefill: int) -> Any:
    """The config of one arm: ``prefill`` = 0 colocated, else that many prefill replicas."""
    from framework.config import EngineConfig

    return EngineConfig(model=LLAMA_70B, tokenizer="smollm2", dtype="bfloat16", executor="sim",
                        executor_params={"profile": f"analytic:{args.device}"}, tensor_parallel_size=args.tp,
                        data_parallel_size=args.replicas, disagg_prefill_replicas=prefill, compile=False,
                        max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_transfer_link_params={"bandwidth_gbps": args.bandwidth_gbps}, router=args.router)


def run(args: argparse.Namespace, prefill: int, rate: float) -> dict[str, Any]:
    """One simulated run: its summary's latency, SLO attainment and goodput."""
    from framework import build_engine
    from framework.core.sampling_params import SamplingParams
    from framework.entrypoints.offline_runner import run_workload
    from framework.metrics.collector import MetricsCollector
    from plugins.executors._sim_disagg import build_disaggregated_sim_engine

    config = engine_config(args, prefill)
    metrics = MetricsCollector(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    engine = build_disaggregated_sim_engine(config, metrics) if prefill else build_engine(config, metrics)
    try:
        records, summary = run_workload(engine, trace(args, rate), SamplingParams(temperature=0.0, ignore_eos=True),
                                        progress=False)
    finally:
        engine.shutdown()
    met = sum(1 for r in records if _meets(r["metrics"], args))
    arm = "colocated" if not prefill else f"{prefill}P{args.replicas - prefill}D"
    row = {"arm": arm, "prefill_replicas": prefill, "rate": rate, "num_requests": len(records),
           "attainment": met / len(records), "goodput": summary["request_goodput"],
           "p90_ttft_ms": _pct([r["metrics"]["ttft_s"] * 1e3 for r in records], 0.9),
           "p90_tpot_ms": _pct([r["metrics"]["tpot_s"] * 1e3 for r in records if r["metrics"]["tpot_s"]], 0.9),
           "mean_transfer_ms": 1e3 * engine.transfer_s_total / max(1, engine.num_transfers) if prefill else 0.0}
    print(f"{arm:>10} {rate:5.1f} req/s: attainment {row['attainment']:.2f}, goodput {row['goodput']:.2f} req/s, "
          f"TTFT p90 {row['p90_ttft_ms']:.0f} ms, TPOT p90 {row['p90_tpot_ms']:.1f} ms", flush=True)
    return row


def _meets(m: dict[str, Any], args: argparse.Namespace) -> bool:
    return m["ttft_s"] * 1e3 <= args.slo_ttft_ms and (m["tpot_s"] is None or m["tpot_s"] * 1e3 <= args.slo_tpot_ms)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def capacity(rows: list[dict[str, Any]], arm: str, attainment: float) -> float:
    """The highest rate at which ``arm`` still meets ``attainment`` (0 when none does)."""
    return max((r["rate"] for r in rows if r["arm"] == arm and r["attainment"] >= attainment), default=0.0)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per (arm, rate)."""
    return markdown_table(["arm", "rate req/s", "SLO attainment", "goodput req/s", "TTFT p90 ms", "TPOT p90 ms",
                           "transfer ms"],
                          [[r["arm"], f"{r['rate']:g}", f"{r['attainment']:.2f}", f"{r['goodput']:.2f}",
                            f"{r['p90_ttft_ms']:.0f}", f"{r['p90_tpot_ms']:.1f}", f"{r['mean_transfer_ms']:.1f}"]
                           for r in rows])


def plot(rows: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    """Attainment and goodput against rate, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        left.plot([r["rate"] for r in mine], [r["attainment"] for r in mine], marker="o", label=arm)
        right.plot([r["rate"] for r in mine], [r["goodput"] for r in mine], marker="o", label=arm)
    left.axhline(args.attainment, color="grey", linestyle=":")
    left.set(xlabel="offered rate, req/s", ylabel="SLO attainment", title="TTFT and TPOT within SLO")
    right.set(xlabel="offered rate, req/s", ylabel="goodput, req/s", title="requests meeting the SLO per second")
    left.legend()
    fig.suptitle(f"Llama-3-70B TP={args.tp} x {args.replicas} replicas, analytic {args.device.upper()} (simulated)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every arm at every rate; print (and optionally write) the table, capacities, JSON and plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="8,16,24,32,40", help="offered Poisson rates, req/s")
    parser.add_argument("--prefill", default="0,1,2", help="prefill replicas per arm (0: colocated)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=2048, help="mean prompt tokens (uniform 0.5x-1.5x)")
    parser.add_argument("--output-len", type=int, default=256, help="mean output tokens (uniform 0.5x-1.5x)")
    parser.add_argument("--slo-ttft-ms", type=float, default=600.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=15.0)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--bandwidth-gbps", type=float, default=400.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--router", default="least_loaded")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = [run(args, int(p), float(rate)) for p in args.prefill.split(",") for rate in args.rates.split(",")]
    print(table(rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    for arm in arms:
        print(f"{arm}: capacity at {args.attainment:.0%} SLO attainment: {capacity(rows, arm, args.attainment):g} req/s "
              f"({capacity(rows, arm, args.attainment) / (args.replicas * args.tp):.3f} req/s per GPU)")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        caps = {arm: capacity(rows, arm, args.attainment) for arm in arms}
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "capacity": caps, "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args, args.plot)
    return rows


if __name__ == "__main__":
    main()
