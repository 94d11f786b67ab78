"""Turn a Hydra sweep directory into one table (CSV + Markdown) and matplotlib PNGs.

``python experiments/collect.py multirun/2026-11-23/00-40-00 [--out DIR] [--metrics k1,k2]``

Each job directory of the sweep holds ``metrics.json`` (flat scalars) and ``.hydra/overrides.yaml``
(what the job varied). The table has one row per job: the varied keys first, then the metrics;
PNGs plot each metric per configuration (bar charts, one bar per job labelled by its overrides).
Nothing is downloaded and no W&B account is needed.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Any

import yaml

DEFAULT_METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                   "p99_tpot_ms", "mean_queue_ms", "peak_num_running_reqs", "mean_num_running_reqs",
                   "peak_kv_cache_usage", "mean_kv_cache_fragmentation", "prefix_cache_hit_rate",
                   "theoretical_prefix_hit_rate", "num_preemptions")


def load_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One dict per job dir with ``metrics.json``: ``{"job": name, "overrides": {k: v}, "metrics": {...}}``.

    Raises:
        FileNotFoundError: no job directory with a ``metrics.json`` under ``sweep_dir``.
    """
    jobs = []
    for metrics_path in sorted(sweep_dir.glob("**/metrics.json")):
        job_dir = metrics_path.parent
        overrides_path = job_dir / ".hydra" / "overrides.yaml"
        overrides = yaml.safe_load(overrides_path.read_text()) if overrides_path.is_file() else []
        pairs = dict(o.lstrip("+").split("=", 1) for o in overrides or [] if "=" in o)
        jobs.append({"job": str(job_dir.relative_to(sweep_dir)), "overrides": pairs,
                     "metrics": json.loads(metrics_path.read_text())})
    if not jobs:
        raise FileNotFoundError(f"no */metrics.json under {sweep_dir}; pass a Hydra multirun directory")
    return jobs


def varied_keys(jobs: list[dict[str, Any]]) -> list[str]:
    """Override keys whose value differs between jobs (the sweep's axes), in first-seen order."""
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job["overrides"] if k not in keys]
    return [k for k in keys if len({str(j["overrides"].get(k)) for j in jobs}) > 1] or keys


def table(jobs: list[dict[str, Any]], metrics: list[str]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows: varied keys then the requested metrics (missing ones blank)."""
    keys = varied_keys(jobs)
    rows = [[job["overrides"].get(k, "") for k in keys] + [job["metrics"].get(m, "") for m in metrics]
            for job in jobs]
    return keys + metrics, rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_outputs(jobs: list[dict[str, Any]], metrics: list[str], out_dir: Path) -> list[Path]:
    """Write ``results.csv``, ``results.md`` and one PNG per metric into ``out_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    header, rows = table(jobs, metrics)
    with open(out_dir / "results.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    written = [out_dir / "results.csv", out_dir / "results.md"]
    keys = varied_keys(jobs)
    labels = [", ".join(f"{k.split('.')[-1]}={job['overrides'].get(k, '')}" for k in keys) for job in jobs]
    for metric in metrics:
        values = [job["metrics"].get(metric) for job in jobs]
        if not any(isinstance(v, (int, float)) for v in values):
            continue
        fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(jobs) + 2), 4.0))
        ax.bar(range(len(jobs)), [v if isinstance(v, (int, float)) else 0 for v in values], color="#4477aa")
        ax.set_xticks(range(len(jobs)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel(metric)
        ax.set_title(metric)
        fig.tight_layout()
        path = out_dir / f"{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """CLI entry: collect a sweep directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: SWEEP_DIR/results)")
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated metrics.json keys")
    args = parser.parse_args(argv)
    jobs = load_jobs(args.sweep_dir)
    paths = write_outputs(jobs, args.metrics.split(","), args.out or args.sweep_dir / "results")
    print((args.out or args.sweep_dir / "results") / "results.md")
    print("\n".join(str(p) for p in paths[2:]))


if __name__ == "__main__":
    main()
