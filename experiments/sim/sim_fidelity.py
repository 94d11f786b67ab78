"""Fidelity of ``executor=sim``: workloads run by the real engine and by the simulator (virtual clock, a measured
profile); TPOT, e2e latency, output throughput and TTFT compared.

The workloads are none of the profile's grid cells (``framework/engine/profiler.py``): the generators of
``conf/workload`` with Poisson and gamma arrivals at several rates or all at once, skewed lengths, shared
prefixes with prefix caching on and off, two schedulers (fcfs, sjf). Real and simulated runs share the
config (eager, ``engine.compile=false``; ``ignore_eos``, so output lengths are the workload's) and
``run.py``'s loop (``framework.entrypoints.offline_runner.run_workload``): a difference is the cost model's.
The gate (issue 45): mean TPOT, mean e2e and output throughput within 5%, TTFT p50 within 10%.

A shared 2-core machine's speed drifts by 10-20% within an hour, more than the gate, so the profile and the
real runs must sample the same hours: ``measure`` runs one profile pass and then one real run of every
workload (each real run's foreign CPU share is recorded); run it for several rounds, then ``compare`` pools
the passes into one profile and holds the simulator against the mean of the rounds:

    python -m experiments.sim.sim_fidelity measure --dir docs/results/sim/rounds --round 1     # ... --round 3
    python -m experiments.sim.sim_fidelity compare --dir docs/results/sim/rounds --profile-out P.json --json-out F.json
    python -m experiments.sim.sim_fidelity run --profile auto --workloads random_r2       # one real, one simulated
    python -m experiments.sim.sim_fidelity table F.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from experiments.common import markdown_table

COMMON = ["engine.compile=false", "sampling.ignore_eos=true", "tracker=none", "ui=none"]
#: name -> the run's overrides (each a config `run.py` accepts)
WORKLOADS: dict[str, list[str]] = {
    "random_r2": ["workload=random", "workload.request_rate=2"],
    "random_r4": ["workload=random", "workload.request_rate=4", "workload.seed=1"],
    "random_gamma_r4": ["workload=random", "workload.request_rate=4", "workload.arrival=gamma",
                        "workload.burstiness=0.5", "workload.seed=2"],
    "random_burst": ["workload=random", "workload.num_prompts=48", "workload.seed=3"],
    "long_tail_fcfs": ["workload=long_tail", "workload.num_prompts=16", "workload.max_model_len=1024",
                       "workload.request_rate=1"],
    "long_tail_sjf": ["workload=long_tail", "workload.num_prompts=16", "workload.max_model_len=1024",
                      "workload.request_rate=1", "scheduler=sjf"],
    "shared_prefix_cache_on": ["workload=shared_prefix", "workload.request_rate=4"],
    "shared_prefix_cache_off": ["workload=shared_prefix", "workload.request_rate=4",
                                "engine.enable_prefix_caching=false"],
}
#: metric -> (summary key, tolerance of |sim / real - 1|)
GATES = {"mean TPOT": ("mean_tpot_ms", 0.05), "mean e2e": ("mean_e2el_ms", 0.05),
         "output tok/s": ("output_throughput", 0.05), "TTFT p50": ("median_ttft_ms", 0.10)}
KEYS = [key for key, _ in GATES.values()] + ["median_tpot_ms", "median_e2el_ms", "num_steps", "num_preemptions",
                                              "prefix_cache_hit_rate"]


def run_once(overrides: list[str]) -> tuple[dict[str, Any], float]:
    """One offline run of ``run.py``'s config with ``overrides``; returns (summary, wall seconds)."""
    from framework import build_engine
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


def real_run(name: str, model: str) -> dict[str, Any]:
    """A real run's gated metrics, its wall time and the CPU share other processes took meanwhile."""
    from framework.engine.profiler import ForeignCpu

    meter = ForeignCpu()
    summary, wall = run_once([f"model={model}", *COMMON, *WORKLOADS[name]])
    return {**{k: summary.get(k) for k in KEYS}, "wall_s": wall, "foreign_cpu_share": meter.share()}


def sim_run(name: str, model: str, profile: str) -> dict[str, Any]:
    """The simulated run (virtual clock) of one workload."""
    summary, wall = run_once([f"model={model}", *COMMON, *WORKLOADS[name], "executor=sim",
                              "executor.params.clock=virtual", f"executor.params.profile={profile}"])
    return {**{k: summary.get(k) for k in KEYS}, "wall_s": wall, "sim_profile": summary.get("sim_profile")}


def row(name: str, reals: list[dict[str, Any]], sim: dict[str, Any]) -> dict[str, Any]:
    """The simulator's relative errors against the mean of the real rounds, and the rounds' own spread."""
    real = {k: statistics.fmean(r[k] for r in reals) for k in KEYS if all(r.get(k) is not None for r in reals)}
    errors = {m: sim[k] / real[k] - 1 for m, (k, _) in GATES.items() if real.get(k)}
    spread = {m: (max(r[k] for r in reals) - min(r[k] for r in reals)) / real[k] for m, (k, _) in GATES.items()
              if real.get(k)}
    passed = all(abs(errors[m]) <= tol for m, (_, tol) in GATES.items() if m in errors)
    return {"workload": name, "overrides": WORKLOADS[name], "errors": errors, "real_spread": spread,
            "passed": passed, "real": real, "sim": sim, "real_rounds": reals}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per workload, each gated metric as real (mean of rounds) / simulated (error)."""
    header = ["workload", *(f"{m}: real / sim (error)" for m in GATES), "rounds (spread of TPOT)", "gate"]
    cells = [[r["workload"],
              *(f"{r['real'][k]:.1f} / {r['sim'][k]:.1f} ({100 * r['errors'][m]:+.1f}%)"
                for m, (k, _) in GATES.items()),
              f"{len(r['real_rounds'])} ({100 * r['real_spread']['mean TPOT']:.0f}%)",
              "pass" if r["passed"] else "FAIL"]
             for r in rows]
    return markdown_table(header, cells)


def _names(spec: str) -> list[str]:
    names = list(WORKLOADS) if spec == "all" else spec.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; valid: {', '.join(WORKLOADS)}")
    return names


def measure(args: argparse.Namespace) -> None:
    """One round: a profile pass, then one real run of each workload."""
    from framework.config import EngineConfig
    from framework.engine.profiler import measure_profile

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    profile = measure_profile(EngineConfig(model=args.model, compile=False), args.grid, seed=args.round)
    profile.save(out / f"profile_pass{args.round}.json")
    print(f"round {args.round}: profile pass, {len(profile.samples)} steps", flush=True)
    reals = {}
    for name in _names(args.workloads):
        reals[name] = real_run(name, args.model)
        print(f"  {name}: mean TPOT {reals[name]['mean_tpot_ms']:.1f} ms, foreign CPU "
              f"{100 * (reals[name]['foreign_cpu_share'] or 0):.1f}%", flush=True)
    (out / f"real_round{args.round}.json").write_text(json.dumps(reals, indent=1) + "\n")


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Pool the rounds' profile passes, simulate every workload, compare with the rounds' mean."""
    from framework.engine.profiler import merge_profiles
    from framework.sim.profile import StepProfile

    folder = Path(args.dir)
    passes = sorted(folder.glob("profile_pass*.json"))
    merged = merge_profiles([StepProfile.load(p) for p in passes])
    profile_path = merged.save(args.profile_out or folder / "profile_merged.json")
    rounds = [json.loads(p.read_text()) for p in sorted(folder.glob("real_round*.json"))]
    rows = []
    for name in [n for n in WORKLOADS if all(n in r for r in rounds)]:
        rows.append(row(name, [r[name] for r in rounds], sim_run(name, args.model, str(profile_path))))
        print(f"{name}: " + ", ".join(f"{m} {100 * e:+.1f}%" for m, e in rows[-1]["errors"].items()), flush=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({"profile": str(profile_path), "num_passes": len(passes),
                                                   "rows": rows}, indent=1) + "\n")
    print(table(rows))
    return rows


def main(argv: list[str] | None = None) -> Any:
    """``measure``, ``compare``, ``run`` (one real and one simulated run per workload) or ``table``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("measure", "compare", "run"):
        p = sub.add_parser(name)
        p.add_argument("--workloads", default="all", help=f"comma list of {', '.join(WORKLOADS)}, or all")
        p.add_argument("--model", default="smollm2", help="a conf/model option (smollm2, stories260K, ...)")
    sub.choices["measure"].add_argument("--dir", required=True)
    sub.choices["measure"].add_argument("--round", type=int, required=True)
    sub.choices["measure"].add_argument("--grid", default="default")
    sub.choices["compare"].add_argument("--dir", required=True)
    sub.choices["compare"].add_argument("--profile-out")
    sub.choices["compare"].add_argument("--json-out")
    sub.choices["run"].add_argument("--profile", default="auto")
    sub.add_parser("table").add_argument("file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "measure":
        return measure(args)
    if args.command == "compare":
        return compare(args)
    if args.command == "table":
        rows = json.loads(Path(args.file).read_text())["rows"]
        print(table(rows))
        return rows
    rows = [row(n, [real_run(n, args.model)], sim_run(n, args.model, args.profile)) for n in _names(args.workloads)]
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
