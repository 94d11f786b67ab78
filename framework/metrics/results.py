"""Sweep results you can look at: a Hydra multirun dir -> one table (CSV + Markdown), PNG plots, one HTML page.

Offline and account-free: reads only the files every run writes (``metrics.json``,
``resolved_config.yaml``, ``.hydra/overrides.yaml``). Generic over metric keys: every flat scalar
in ``metrics.json`` (nested dicts flattened with dots, lists skipped) becomes a column, so new
metrics (KV usage, hit rate, peak concurrency...) need no change here.
Used by ``servelab results SWEEP_DIR``.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)
_WARNED_NO_MATPLOTLIB: list[bool] = []  # plot_metrics' missing-matplotlib warning, once per process

Scalar = int | float | str | bool | None
# (png stem, title, metric keys): the default plots; keys missing from every job are skipped
DEFAULT_PLOTS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("throughput", "Output throughput (tok/s)", ("output_throughput", "total_token_throughput")),
    ("ttft", "TTFT (ms)", ("median_ttft_ms", "p99_ttft_ms")),
    ("tpot", "TPOT (ms)", ("median_tpot_ms", "p99_tpot_ms")),
)


@dataclass
class Job:
    """One finished job of a sweep: its directory, flattened resolved config, overrides and metrics."""

    path: Path
    config: dict[str, Scalar]
    overrides: list[str]
    metrics: dict[str, Scalar]


@dataclass
class SweepResults:
    """The table of a sweep: ``varied`` config keys and ``metric_keys`` columns, one row per job."""

    jobs: list[Job]
    varied: list[str]
    metric_keys: list[str]
    files: dict[str, Path] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Scalar]]:
        """Table rows: ``job`` (dir relative name), each varied key, each metric."""
        return [{"job": job.path.name, **{k: job.config.get(k) for k in self.varied},
                 **{k: job.metrics.get(k) for k in self.metric_keys}} for job in self.jobs]


def flatten(tree: Any, prefix: str = "") -> dict[str, Scalar]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists become their JSON text, so they stay comparable."""
    if isinstance(tree, Mapping):
        out: dict[str, Scalar] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, list | tuple):
        return {prefix[:-1]: json.dumps(tree)}
    return {prefix[:-1]: tree}


def _scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, Scalar]:
    """Flat scalar metrics of a ``metrics.json`` (nested dicts dotted, lists dropped)."""
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, Mapping):
            flat.update({k: v for k, v in flatten(value, f"{key}.").items() if not str(v).startswith("[")})
        elif value is None or isinstance(value, int | float | str | bool):
            flat[key] = value
    return flat


def _job_sort_key(path: Path) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.parts)


def load_jobs(sweep_dir: str | Path) -> list[Job]:
    """Every job dir under ``sweep_dir`` (any depth) holding a ``metrics.json``, in job-number order.

    Raises:
        FileNotFoundError: ``sweep_dir`` does not exist or holds no ``metrics.json``.
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"sweep dir not found: {root}")
    paths = sorted((p.parent for p in root.rglob("metrics.json")), key=lambda p: _job_sort_key(p.relative_to(root)))
    if not paths:
        raise FileNotFoundError(f"no metrics.json under {root}: is it a finished `python run.py -m ...` dir?")
    jobs = []
    for path in paths:
        cfg_file, ovr_file = path / "resolved_config.yaml", path / ".hydra" / "overrides.yaml"
        config = flatten(yaml.safe_load(cfg_file.read_text()) or {}) if cfg_file.is_file() else {}
        overrides = list(yaml.safe_load(ovr_file.read_text()) or []) if ovr_file.is_file() else []
        metrics = _scalar_metrics(json.loads((path / "metrics.json").read_text()))
        jobs.append(Job(path=path, config=config, overrides=overrides, metrics=metrics))
    return jobs


def varied_keys(jobs: list[Job]) -> list[str]:
    """Config keys whose value differs between jobs, in command-line order; with a single job, the keys
    it overrode on the command line (``scheduler=fcfs`` counts as ``scheduler.name``)."""
    overridden = []
    for name in (o.split("=", 1)[0].lstrip("+~") for o in jobs[0].overrides) if jobs else ():
        key = name if name in jobs[0].config else f"{name}.name"
        if key in jobs[0].config and not key.startswith("hydra."):
            overridden.append(key)
    if len(jobs) == 1:
        return overridden
    keys = list(dict.fromkeys(k for job in jobs for k in job.config))
    varied = [k for k in keys if len({json.dumps(job.config.get(k), default=str) for job in jobs}) > 1]
    # command-line order first (what the user swept), then the rest in config order
    return sorted(varied, key=lambda k: overridden.index(k) if k in overridden else len(overridden))


def collect(sweep_dir: str | Path, metrics: Iterable[str] | None = None) -> SweepResults:
    """Load a sweep into a :class:`SweepResults` (no files written).

    Args:
        metrics: metric columns; ``None`` = every scalar metric any job reported, in first-seen order.
    """
    jobs = load_jobs(sweep_dir)
    all_metrics = list(dict.fromkeys(k for job in jobs for k in job.metrics))
    return SweepResults(jobs=jobs, varied=varied_keys(jobs), metric_keys=list(metrics) if metrics else all_metrics)


def _fmt(value: Scalar) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def to_markdown(results: SweepResults) -> str:
    """The table as GitHub Markdown (floats with 4 significant digits)."""
    rows = results.rows()
    header = list(rows[0]) if rows else ["job"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _group(results: SweepResults) -> tuple[list[str], list[str], dict[tuple[str, str], Job]]:
    """x groups (all varied keys but the last) and hues (the last varied key) of the bar charts."""
    def part(job: Job, keys: list[str]) -> str:
        return ",".join(f"{k}={job.config.get(k)}" for k in keys) or job.path.name

    outer, inner = results.varied[:-1], results.varied[-1:]
    cells = {}
    for job in results.jobs:
        x = part(job, outer) if outer else "all"
        hue = part(job, inner) if inner else job.path.name
        cells[(x, hue)] = job
    xs = list(dict.fromkeys(x for x, _ in cells))
    hues = list(dict.fromkeys(h for _, h in cells))
    return xs, hues, cells


def plot_metrics(results: SweepResults, keys: tuple[str, ...], title: str, path: Path) -> Path | None:
    """Grouped bar chart PNG, one panel per metric in ``keys``: x = all varied keys but the last,
    bars = values of the last varied key. Returns ``path``, or ``None`` when no job has any of ``keys`` or
    matplotlib is not installed (the ``plots`` extra; logged once, naming the fix: the tables need no plots)."""
    try:
        import matplotlib
    except ImportError:
        if not _WARNED_NO_MATPLOTLIB:
            _WARNED_NO_MATPLOTLIB.append(True)
            logger.warning("servelab results: plots skipped, matplotlib is not installed (the core install leaves "
                           "it out): pip install 'servelab[plots]'")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = tuple(k for k in keys if any(isinstance(j.metrics.get(k), int | float) for j in results.jobs))
    if not keys:
        return None
    xs, hues, cells = _group(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(max(5.0, 1.2 * len(xs) * len(hues)) * len(keys) ** 0.5 + 2, 4),
                             squeeze=False)
    width = 0.8 / max(1, len(hues))
    for ax, key in zip(axes[0], keys):
        for h, hue in enumerate(hues):
            values = [cells[(x, hue)].metrics.get(key) if (x, hue) in cells else None for x in xs]
            heights = [float(v) if isinstance(v, int | float) else 0.0 for v in values]
            ax.bar([i + h * width for i in range(len(xs))], heights, width, label=hue)
        ax.set_xticks([i + width * (len(hues) - 1) / 2 for i in range(len(xs))], xs, rotation=20, ha="right",
                      fontsize=8)
        ax.set_title(key, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _html(results: SweepResults, sweep_dir: Path, pngs: list[Path]) -> str:
    """One self-contained page: the table and every PNG inlined as base64."""
    rows = results.rows()
    header = list(rows[0]) if rows else []
    table = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>"]
    table += ["<tr>" + "".join(f"<td>{html.escape(_fmt(row[h]))}</td>" for h in header) + "</tr>" for row in rows]
    imgs = [f'<h3>{html.escape(p.stem)}</h3><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
            f'{base64.b64encode(p.read_bytes()).decode()}"/>' for p in pngs]
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:12px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>servelab sweep {html.escape(sweep_dir.name)}"
            f"</title><style>{style}</style></head><body><h1>servelab sweep: {html.escape(str(sweep_dir))}</h1>"
            f"<p>{len(results.jobs)} jobs; varied: {html.escape(', '.join(results.varied) or '(nothing)')}</p>"
            + "\n".join(table) + "</table>\n" + "\n".join(imgs) + "</body></html>\n")


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None, metrics: Iterable[str] | None = None,
                 extra_plots: Iterable[str] = ()) -> SweepResults:
    """Write ``results.csv``, ``results.md``, ``<plot>.png`` and ``results.html`` into ``out_dir``
    (default ``SWEEP_DIR/results``); ``results.files`` maps each kind to its path.

    Args:
        metrics: table columns (``None`` = all scalar metrics).
        extra_plots: more metric keys, one PNG each (e.g. ``prefix_cache_hit_rate``).

    Raises:
        FileNotFoundError: see :func:`load_jobs`.
    """
    sweep_dir = Path(sweep_dir)
    results = collect(sweep_dir, metrics)
    out = Path(out_dir) if out_dir is not None else sweep_dir / "results"
    out.mkdir(parents=True, exist_ok=True)
    rows = results.rows()
    with open(out / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.md").write_text(to_markdown(results), encoding="utf-8")
    results.files.update(csv=out / "results.csv", md=out / "results.md")
    specs = list(DEFAULT_PLOTS) + [(key.replace("/", "_"), key, (key,)) for key in extra_plots]
    pngs = [p for stem, title, keys in specs if (p := plot_metrics(results, keys, title, out / f"{stem}.png"))]
    results.files.update({p.stem: p for p in pngs})
    (out / "results.html").write_text(_html(results, sweep_dir, pngs), encoding="utf-8")
    results.files["html"] = out / "results.html"
    return results


def main(argv: list[str] | None = None) -> int:
    """``servelab results SWEEP_DIR [--out DIR] [--plot KEY ...] [--metrics KEY ...]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="servelab results", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a Hydra multirun dir (multirun/<date>/<time>) or a single run dir")
    parser.add_argument("--out", default=None, help="output dir (default SWEEP_DIR/results)")
    parser.add_argument("--plot", nargs="*", default=[], metavar="KEY",
                        help="extra metrics to plot, one PNG each (e.g. prefix_cache_hit_rate)")
    parser.add_argument("--metrics", nargs="*", default=None, metavar="KEY", help="table columns (default: all)")
    args = parser.parse_args(argv)
    results = write_report(args.sweep_dir, args.out, args.metrics, args.plot)
    print(f"{len(results.jobs)} jobs; varied: {', '.join(results.varied) or '(nothing)'}")
    for kind, path in results.files.items():
        print(f"{kind}: {path}")
    return 0
