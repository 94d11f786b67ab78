"""Which tensor / pipeline / expert-parallel layout, for Llama-3-70B and a Mixtral-8x22B-class MoE on 8 and 16
analytic H100s, through ``executor=sim`` (``framework/sim/parallel_cost.py`` prices PP's GPipe bubbles and stage
hand-offs, EP's all-to-all bytes and expert imbalance). Each layout serves the same burst of requests (all at
t=0: a throughput test) with the GPUs left over as data-parallel replicas (``gpus / (tp * pp)``); the table gives
output throughput, mean TPOT and TTFT, and the pipeline's bubble share of stage-time. All links are priced at the
device's NVLink bandwidth (a 16-GPU TP group spans two nodes in reality: the TP=16 rows flatter it). Every number
is analytic: a roofline of published H100 figures, not a measurement.

    python -m experiments.sim.sim_parallel_choice --gpus 8 --models llama-3-70b --num-requests 32   # quick
    python -m experiments.sim.sim_parallel_choice --json-out docs/results/sim/parallel_choice.json \\
        --plot docs/results/sim/parallel_choice.png
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path
from typing import Any

from experiments.common import markdown_table

REPO = Path(__file__).resolve().parents[2]
MODELS = {"llama-3-70b": REPO / "models" / "llama-3-70b",
          "mixtral-8x22b": REPO / "experiments" / "sim" / "shapes" / "mixtral-8x22b"}
#: (tp, pp, ep) layouts per model; a layout runs on a GPU count it divides
LAYOUTS = {"llama-3-70b": [(8, 1, False), (4, 2, False), (2, 4, False), (16, 1, False), (8, 2, False)],
           "mixtral-8x22b": [(8, 1, False), (8, 1, True), (4, 2, False), (4, 2, True), (16, 1, False), (8, 2, True)]}


def burst(args: argparse.Namespace) -> list[Any]:
    """``num_requests`` requests at t=0, prompt and output lengths uniform in 0.5x-1.5x of the means (seeded)."""
    from framework.workloads.item import WorkloadItem

    rng = random.Random(args.seed)
    return [WorkloadItem(f"r{i}", prompt_token_ids=[rng.randrange(100, 30000) for _ in range(
        rng.randint(args.input_len // 2, args.input_len * 3 // 2))],
        max_tokens=rng.randint(args.output_len // 2, args.output_len * 3 // 2)) for i in range(args.num_requests)]


def run(args: argparse.Namespace, model: str, gpus: int, tp: int, pp: int, ep: bool) -> dict[str, Any]:
    """One layout on ``gpus`` GPUs: throughput, TPOT, TTFT and bubble fraction."""
    from framework import build_engine
    from framework.config import EngineConfig
    from framework.core.sampling_params import SamplingParams
    from framework.entrypoints.offline_runner import run_workload

    params: dict[str, Any] = {"profile": f"analytic:{args.device}"}
    if ep and args.expert_skew != 1.0:
        params["expert_skew"] = args.expert_skew
    config = EngineConfig(model=str(MODELS[model]), tokenizer="smollm2", dtype="bfloat16", executor="sim",
                          executor_params=params, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          enable_expert_parallel=ep, data_parallel_size=gpus // (tp * pp), compile=False,
                          max_model_len=8192, max_num_seqs=args.max_num_seqs)
    engine = build_engine(config)
    try:
        _, summary = run_workload(engine, burst(args), SamplingParams(temperature=0.0, ignore_eos=True), progress=False)
        replicas = getattr(engine, "replicas", [engine])
        busy = sum(r.executor.predictor.pipeline_busy_s for r in replicas)
        bubble = sum(r.executor.predictor.pipeline_bubble_s for r in replicas)
    finally:
        engine.shutdown()
    row = {"model": model, "gpus": gpus, "tp": tp, "pp": pp, "ep": ep, "dp": gpus // (tp * pp),
           "output_throughput": summary["output_throughput"], "mean_tpot_ms": summary["mean_tpot_ms"],
           "mean_ttft_ms": summary["mean_ttft_ms"], "bubble_fraction": bubble / (busy + bubble) if busy else 0.0}
    print(f"{model} {gpus} GPUs TP{tp} PP{pp} EP{int(ep)} DP{row['dp']}: {row['output_throughput']:.0f} tok/s, "
          f"TPOT {row['mean_tpot_ms']:.1f} ms, TTFT {row['mean_ttft_ms']:.0f} ms, bubble {row['bubble_fraction']:.2f}",
          flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one row per (model, GPUs, layout)."""
    return markdown_table(["model", "GPUs", "TP", "PP", "EP", "DP", "out tok/s", "TPOT mean ms", "TTFT mean ms",
                           "bubble"],
                          [[r["model"], r["gpus"], r["tp"], r["pp"], "on" if r["ep"] else "off", r["dp"],
                            f"{r['output_throughput']:.0f}", f"{r['mean_tpot_ms']:.1f}", f"{r['mean_ttft_ms']:.0f}",
                            f"{r['bubble_fraction']:.2f}"] for r in rows])


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Throughput per layout, one panel per model, bars grouped by GPU count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"{r['gpus']}: TP{r['tp']} PP{r['pp']}{' EP' if r['ep'] else ''}" for r in mine]
        ax.barh(labels, [r["output_throughput"] for r in mine])
        ax.set(xlabel="output tokens/s (simulated)", title=model)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run every layout of every model on every GPU count it divides; print (and optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default="8,16")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--expert-skew", type=float, default=1.3, help="EP: busiest rank's expert load / mean")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = [run(args, model, int(g), tp, pp, ep) for model in args.models.split(",") for g in args.gpus.split(",")
            for tp, pp, ep in LAYOUTS[model] if int(g) % (tp * pp) == 0]
    print(table(rows))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
