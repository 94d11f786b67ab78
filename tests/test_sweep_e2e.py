"""End to end sweeps on stories260K: a 2x2 multirun (basic and joblib launchers) -> offline W&B runs in one
group with the flattened config, run_record.json per job, ``servelab results`` table/PNGs/HTML, and a rerun
of one job from its saved config giving identical greedy outputs. The basic launcher's sweep, its ``servelab
results``, a ``results`` on a missing folder and the rerun run once, in one Python process
(``helpers.run_in_one_process``: each command as its own ``servelab`` process would, with its own exit status
and output), so torch, transformers and Hydra are imported once for the four commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EAGER_KERNEL, run_in_one_process
from wandb_offline import offline_run_bytes

REPO = Path(__file__).resolve().parents[1]
GRID = ("model=stories260K", "scheduler=fcfs,priority", "engine.max_num_seqs=2,8", "sampling.max_tokens=8",
        "workload.limit=3", EAGER_KERNEL)


def servelab(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_MODE", None)
    return subprocess.run([sys.executable, "-m", "framework.entrypoints.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


SWEEP_GROUP = "2026-01-01_12-00-00"


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """``(sweep dir, name -> finished command)``: the 2x2 grid under the basic launcher (``sweep``), ``servelab
    results`` on it (``results``) and on a missing folder (``results_missing``), then ``servelab rerun`` of its
    last job (``rerun``), in this order in one process."""
    root = tmp_path_factory.mktemp("sweep_e2e")
    sweep = root / "multirun" / "2026-01-01" / "12-00-00"
    cli = ["-m", "framework.entrypoints.cli"]
    commands = {"sweep": [*cli, "-m", *GRID, f"hydra.sweep.dir={sweep}"],
                "results": [*cli, "results", str(sweep), "--plot", "prefix_cache_hit_rate"],
                "results_missing": [*cli, "results", str(root / "nope")],
                "rerun": [*cli, "rerun", str(sweep / "3"), "tracker.name=none"]}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    env.pop("WANDB_MODE", None)
    return sweep, run_in_one_process(commands, root / "logs", env=env, timeout=1600)  # 400 s a command


def token_ids(run_dir: Path) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in (run_dir / "outputs.jsonl").read_text().splitlines()]


def check_results(sweep: Path, num_jobs: int = 4, swept: tuple[str, ...] = ("scheduler.name", "engine.max_num_seqs"),
                  proc: subprocess.CompletedProcess | None = None) -> None:
    """What ``servelab results`` wrote for a sweep: one row per job (``num_jobs``), the swept keys as columns.
    ``proc``: the finished ``servelab results`` command; ``None`` runs its ``main`` in this process (the
    command's start-up being checked once already)."""
    if proc is not None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        from framework.metrics.results import main as results_main

        assert results_main([str(sweep), "--plot", "prefix_cache_hit_rate"]) == 0
    out = sweep / "results"
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert header[:1 + len(swept)] == ["job", *swept] and "output_throughput" in header
    assert len((out / "results.md").read_text().splitlines()) == 2 + num_jobs
    for stem in ("throughput", "ttft", "tpot", "prefix_cache_hit_rate"):
        assert (out / f"{stem}.png").stat().st_size > 1000
    assert (out / "results.html").read_text().count("data:image/png;base64,") == 4


def test_basic_launcher_sweep_is_one_wandb_group_and_reruns_identically(basic_sweep):
    sweep, procs = basic_sweep
    proc = procs["sweep"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.name.isdigit())
    assert len(jobs) == 4
    for job in jobs:
        record = json.loads((job / "run_record.json").read_text())
        assert record["sweep_group"] == SWEEP_GROUP and record["servelab"]["sha"]
        assert record["plugins"]["scheduler"]["package"] == "servelab" and record["versions"]["torch"]
        data = offline_run_bytes(job)
        assert SWEEP_GROUP.encode() in data  # the W&B group
        assert b"scheduler.name" in data and b"engine.max_num_seqs" in data  # flattened config
        assert b"servelab_run.servelab.sha" in data
    check_results(sweep, proc=procs["results"])

    proc = procs["rerun"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rerun = jobs[3] / "rerun-0"
    assert "priority" in (rerun / "resolved_config.yaml").read_text()
    assert token_ids(rerun) == token_ids(jobs[3]) and all(token_ids(rerun))


@pytest.mark.slow
def test_joblib_launcher_sweep_with_tensor_parallel_jobs(tmp_path):
    """Two jobs in two joblib worker processes at once (the 2x2 grid runs under the basic launcher above),
    each job's model sharded over two ``mp`` worker processes started from inside its joblib (loky) worker
    (their spawn must not inherit loky's start method); ~55 s here."""
    sweep = tmp_path / "sweep"
    proc = servelab("-m", "model=stories260K", "scheduler=fcfs,priority", "parallel.tensor_parallel_size=2",
                    "sampling.max_tokens=4", "workload.limit=3", "tracker=none", "hydra/launcher=joblib", EAGER_KERNEL,
                    "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if (p / "metrics.json").is_file()) == ["0", "1"]
    check_results(sweep, num_jobs=2, swept=("scheduler.name",))


def test_results_on_a_missing_dir_fails_clearly(basic_sweep):
    proc = basic_sweep[1]["results_missing"]
    assert proc.returncode != 0 and "not found" in proc.stderr


def test_local_ray_launcher_sweep(tmp_path):
    """Only where the optional ``ray`` extra is installed (``pip install -e ".[ray]" "torch==2.13.0"``; it pins
    cloudpickle 2.2.1, which conflicts with joblib>=1.6's cloudpickle>=3, so the default env leaves it out)."""
    import pytest

    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    sweep = tmp_path / "sweep"
    proc = servelab("-m", *GRID, "tracker=none", "hydra/launcher=ray", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if (p / "metrics.json").is_file()) == ["0", "1", "2", "3"]
    check_results(sweep)
