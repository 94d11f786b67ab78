"""Fidelity of ``executor=sim``: the same workloads run by the real engine and by the simulator (virtual clock,
a measured profile), their TPOT, e2e latency, output throughput and TTFT compared.

The workloads are none of the profile's grid cells (``framework/engine/profiler.py``): the generators of
``conf/workload`` with Poisson and gamma arrivals at several rates, all at once, skewed lengths, shared
prefixes with prefix caching on and off, and two schedulers (fcfs, sjf). Both runs use the same
config (eager: ``engine.compile=false``; ``ignore_eos``, so the output lengths are the workload's) and
``run.py``'s own loop (``framework.entrypoints.offline_runner.run_workload``), so a difference is the cost
model's. The gate (issue 45): mean TPOT, mean e2e and output throughput within 5%, TTFT p50 within 10%.

    python experiments/sim_fidelity.py --workloads all --json-out docs/results/sim/fidelity.json
    python experiments/sim_fidelity.py --table docs/results/sim/fidelity.json     # the Markdown table again
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMMON = ["engine.compile=false", "sampling.ignore_eos=true", "tracker=none", "ui=none"]
#: name -> the run's overrides (each a config `run.py` accepts)
WORKLOADS: dict[str, list[str]] = {
    "random_r2": ["workload=random", "workload.request_rate=2"],
    "random_r4": ["workload=random", "workload.request_rate=4", "workload.seed=1"],
    "random_gamma_r4": ["workload=random", "workload.request_rate=4", "workload.arrival=gamma",
                        "workload.burstiness=0.5", "workload.seed=2"],
    "random_burst": ["workload=random", "workload.num_prompts=48", "workload.seed=3"],
    "long_tail_fcfs": ["workload=long_tail", "workload.num_prompts=24", "workload.max_model_len=1024",
                       "workload.request_rate=1"],
    "long_tail_sjf": ["workload=long_tail", "workload.num_prompts=24", "workload.max_model_len=1024",
                      "workload.request_rate=1", "scheduler=sjf"],
    "shared_prefix_cache_on": ["workload=shared_prefix", "workload.request_rate=4"],
    "shared_prefix_cache_off": ["workload=shared_prefix", "workload.request_rate=4",
                                "engine.enable_prefix_caching=false"],
}
#: metric -> (summary key, tolerance of |sim / real - 1|)
GATES = {"mean TPOT": ("mean_tpot_ms", 0.05), "mean e2e": ("mean_e2el_ms", 0.05),
         "output tok/s": ("output_throughput", 0.05), "TTFT p50": ("median_ttft_ms", 0.10)}
SHOWN = {"TPOT p50": "median_tpot_ms", "e2e p50": "median_e2el_ms", "steps": "num_steps",
         "preemptions": "num_preemptions", "prefix hit rate": "prefix_cache_hit_rate"}
KEYS = [key for key, _ in GATES.values()] + list(SHOWN.values())


def run_once(overrides: list[str]) -> tuple[dict[str, Any], float]:
    """One offline run of ``run.py``'s config with ``overrides``; returns (summary, wall seconds)."""
    from framework.engine.builder import build_engine
    from framework.entrypoints.hydra_config import engine_config_from_cfg, sampling_params_from_cfg
    from framework.entrypoints.offline_runner import run_workload
    from framework.entrypoints.profile import compose_config
    from framework.workloads.workload import build_workload

    cfg = compose_config(overrides)
    engine = build_engine(engine_config_from_cfg(cfg))
    try:
        items = build_workload(cfg.workload, engine.tokenizer, vocab_size=engine.vocab_size,
                               max_model_len=engine.max_model_len)
        start = time.perf_counter()
        _, summary = run_workload(engine, items, sampling_params_from_cfg(cfg.sampling), progress=False)
        return summary, time.perf_counter() - start
    finally:
        engine.shutdown()


def compare(name: str, profile: str, model: str) -> dict[str, Any]:
    """The real and the simulated run of one workload, and the simulator's relative errors."""
    base = [f"model={model}", *COMMON, *WORKLOADS[name]]
    real, real_wall = run_once(base)
    sim, sim_wall = run_once([*base, "executor=sim", "executor.params.clock=virtual",
                              f"executor.params.profile={profile}"])
    errors = {metric: sim[key] / real[key] - 1 for metric, (key, _) in GATES.items() if real.get(key)}
    row = {"workload": name, "overrides": WORKLOADS[name], "errors": errors,
           "passed": all(abs(errors[m]) <= tol for m, (_, tol) in GATES.items() if m in errors),
           "real": {k: real.get(k) for k in KEYS}, "sim": {k: sim.get(k) for k in KEYS},
           "real_wall_s": real_wall, "sim_wall_s": sim_wall, "sim_profile": sim.get("sim_profile")}
    print(f"{name}: " + ", ".join(f"{m} {100 * e:+.1f}%" for m, e in errors.items())
          + f" ({'pass' if row['passed'] else 'FAIL'}; real {real_wall:.0f} s, sim {sim_wall:.1f} s)", flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per workload the real value, the simulated one and the error of each gated metric."""
    head = "| workload | " + " | ".join(f"{m} real / sim (error)" for m in GATES) + " | steps real / sim | gate |"
    lines = [head, "|" + "---|" * (len(GATES) + 3)]
    for row in rows:
        cells = []
        for metric, (key, _) in GATES.items():
            real, sim = row["real"][key], row["sim"][key]
            cells.append(f"{real:.1f} / {sim:.1f} ({100 * row['errors'][metric]:+.1f}%)")
        steps = f"{row['real']['num_steps']} / {row['sim']['num_steps']}"
        lines.append(f"| {row['workload']} | " + " | ".join(cells) + f" | {steps} | {'pass' if row['passed'] else 'FAIL'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run the chosen workloads (or only print the table of a JSON file); returns the rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="all", help=f"comma list of {', '.join(WORKLOADS)}, or all")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--profile", default="auto", help="executor.params.profile of the simulated runs")
    parser.add_argument("--json-out", help="write (merge into) this JSON file, one row per workload")
    parser.add_argument("--table", help="print the Markdown table of a JSON file written before, and exit")
    args = parser.parse_args(argv)
    if args.table:
        rows = json.loads(Path(args.table).read_text())["rows"]
        print(table(rows))
        return rows
    logging.basicConfig(level=logging.WARNING)
    names = list(WORKLOADS) if args.workloads == "all" else args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; valid: {', '.join(WORKLOADS)}")
    rows = [compare(name, args.profile, args.model) for name in names]
    if args.json_out:
        path = Path(args.json_out)
        old = json.loads(path.read_text())["rows"] if path.is_file() else []
        merged = {r["workload"]: r for r in old} | {r["workload"]: r for r in rows}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": [merged[n] for n in WORKLOADS if n in merged]}, indent=1) + "\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
