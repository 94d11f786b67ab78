"""``python run.py executor=sim``: a Hydra multirun of simulated jobs writes what a real run writes (the same
``metrics.json`` keys, plus ``simulated`` and ``sim_profile`` in every record), W&B runs included, and
``servelab results`` tabulates it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import EAGER_KERNEL, REPO
from sim_helpers import linear_profile

COMMON = ["model=stories260K", "engine.compile=false", EAGER_KERNEL, "workload=random", "workload.num_prompts=6",
          "workload.input_len_max=64", "workload.output_len_max=24", "sampling.ignore_eos=true", "ui=none"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)
    return subprocess.run([sys.executable, "run.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_simulated_multirun_writes_a_real_runs_files_and_results_tabulate_it(tmp_path):
    real_dir, sweep = tmp_path / "real", tmp_path / "sweep"
    proc = _run(*COMMON, "tracker=none", f"hydra.run.dir={real_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = linear_profile(tmp_path / "profile.json", 0.04)
    proc = _run("-m", *COMMON, "executor=sim", f"executor.params.profile={profile}", "scheduler=fcfs,sjf",
                f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    real = json.loads((real_dir / "metrics.json").read_text())
    for job in ("0", "1"):
        sim = json.loads((sweep / job / "metrics.json").read_text())
        assert set(sim) == set(real), set(sim) ^ set(real)
        assert sim["simulated"] is True and sim["sim_profile"] == "measured:constant@?"
        assert real["simulated"] is False and real["sim_profile"] is None
        assert sim["num_requests"] == real["num_requests"] == 6
        assert sim["total_output_tokens"] == real["total_output_tokens"]  # ignore_eos: the workload's lengths
        records = [json.loads(line) for line in (sweep / job / "outputs.jsonl").read_text().splitlines()]
        assert all(r["simulated"] is True and r["sim_profile"] == "measured:constant@?" for r in records)
        assert len(list((sweep / job / "wandb").glob("offline-run-*"))) == 1
        assert (sweep / job / "steps.csv").is_file()

    from framework.entrypoints.cli import main

    out = tmp_path / "table"
    assert main(["results", str(sweep), "--out", str(out)]) == 0
    table = (out / "results.md").read_text()
    assert "simulated" in table and "sim_profile" in table and "sjf" in table
