"""End to end: ``python run.py`` on stories260K writes outputs, metrics, the Hydra config and an offline W&B run;
configuration mistakes print their message alone. Every command of this module runs once, all of them in one
Python process (``helpers.run_in_one_process``: each as ``python run.py ...`` would, its own exit status, stdout
and stderr), so torch, transformers and Hydra are imported once rather than once per command."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import EAGER_KERNEL, run_in_one_process

PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily wanted to play with her friend Tom."]
LONG_PROMPT = "the cat sat on the mat " * 200  # > 512 tokens: over stories260K's max_model_len
CONFIG_MISTAKES = {  # name: (command, fragments the message names)
    "chat_without_template": (["run.py", "model=stories260K", "tracker=none", "workload.chat=true"],
                              ["workload.chat=false"]),
    "unknown_scheduler": (["run.py", "scheduler=nope"], ["unknown scheduler 'nope'", "fcfs", "priority"]),
    "gpu_backend_run": (["run.py", "model=stories260K", "attention=flashinfer", "tracker=none"],
                        ["'flashinfer' needs a CUDA GPU"]),
    "gpu_backend_serve": (["-m", "framework.entrypoints.cli", "serve", "model=stories260K", "attention=flashinfer",
                           "tracker=none"], ["'flashinfer' needs a CUDA GPU"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """``(root, name -> finished command)``: every command of this module, run once in one process under
    ``root`` (each run's Hydra dir is ``root / name``)."""
    root = tmp_path_factory.mktemp("run_e2e")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join([*PROMPTS, LONG_PROMPT]) + "\n")
    commands = {name: [*cmd, f"hydra.run.dir={root / name}"] for name, (cmd, _) in CONFIG_MISTAKES.items()}
    commands["bad_arrivals"] = ["run.py", EAGER_KERNEL, "model=stories260K", "workload=random",
                                "workload.request_rate=0", "tracker=none", f"hydra.run.dir={root / 'bad_arrivals'}"]
    commands["shared_prefix"] = [
        "run.py", EAGER_KERNEL, "model=stories260K", "workload=shared_prefix", "workload.num_prefixes=2",
        "workload.questions_per_prefix=3", "workload.prefix_len=48", "workload.question_len=8",
        "workload.output_len=4", "workload.request_rate=200", "kv_cache=radix", "scheduler=lpm", "tracker=none",
        f"hydra.run.dir={root / 'shared_prefix'}"]
    commands["offline"] = ["run.py", EAGER_KERNEL, "model=stories260K", "workload=prompts", f"workload.path={prompts}",
                           "workload.chat=false", "sampling.temperature=0", "sampling.max_tokens=16",
                           f"hydra.run.dir={root / 'offline'}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    env.pop("WANDB_MODE", None)  # the tracker's mode comes from the config
    return root, run_in_one_process(commands, root / "logs", env=env, timeout=1500)  # 300 s a command


def test_offline_run_writes_everything_and_records_a_rejected_prompt(runs):
    """One run: three prompts served, a fourth over ``max_model_len`` recorded as rejected while the others run."""
    root, procs = runs
    run_dir, proc = root / "offline", procs["offline"]
    assert proc.returncode == 0, proc.stderr[-3000:]

    *records, rejected = [json.loads(line) for line in (run_dir / "outputs.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    for r in records:
        assert {"request_id", "prompt", "text", "token_ids", "finish_reason", "error", "metrics"} <= set(r)
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None
        assert 1 <= len(r["token_ids"]) <= 16
        assert r["metrics"]["num_output_tokens"] == len(r["token_ids"]) and r["metrics"]["ttft_s"] > 0
    assert rejected["finish_reason"] == "abort" and "max_model_len" in rejected["error"]

    summary = json.loads((run_dir / "metrics.json").read_text())
    for key in ("num_requests", "duration_s", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                "peak_kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions", "num_steps", "forward_frac",
                "num_rejected"):
        assert key in summary, key
    assert summary["num_requests"] == len(PROMPTS) and summary["num_rejected"] == 1
    assert summary["total_output_tokens"] == sum(len(r["token_ids"]) for r in records)

    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "path: stories260K" in (run_dir / "resolved_config.yaml").read_text()
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert "request_throughput" in proc.stdout  # the summary table


def _assert_config_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2 and the message alone on stderr: no traceback, no Hydra search path."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "servelab: error: " in proc.stderr and all(f in proc.stderr for f in fragments), proc.stderr
    assert "Traceback" not in proc.stderr and "Config search path" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", CONFIG_MISTAKES)
def test_configuration_mistakes_print_the_message_alone(runs, name):
    _assert_config_error(runs[1][name], *CONFIG_MISTAKES[name][1])


def test_shared_prefix_run_reports_kv_metrics_and_timeline(runs):
    root, procs = runs
    run_dir, proc = root / "shared_prefix", procs["shared_prefix"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["num_requests"] == 6
    for key in ("theoretical_prefix_hit_rate", "prefix_cache_hit_rate", "peak_num_running_reqs",
                "mean_num_running_reqs", "mean_kv_cache_usage", "mean_kv_cache_fragmentation", "mean_queue_ms"):
        assert key in summary, key
    assert 0 < summary["theoretical_prefix_hit_rate"] <= 1
    assert summary["prefix_cache_hit_rate"] <= summary["theoretical_prefix_hit_rate"] + 1e-9
    header = (run_dir / "steps.csv").read_text().splitlines()[0]
    assert "kv_cache_usage" in header and "num_running_reqs" in header
    assert not (run_dir / "wandb").exists()  # tracker=none


def test_bad_arrivals_fail_before_weights_load(runs):
    proc = runs[1]["bad_arrivals"]
    _assert_config_error(proc, "request_rate must be > 0")
    assert "Loading weights" not in proc.stderr
