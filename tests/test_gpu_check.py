"""``scripts/gpu_check.sh``: its dry run works on a machine without CUDA (lists the steps, and pytest
collects the GPU tests), and its run writes every file of ``$OUT`` (here with one GPU test, skipped, and a
tiny benchmark), so a GPU session loses no minutes to a broken script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO, STORIES

sys.path.insert(0, str(REPO / "scripts"))

import gpu_check  # noqa: E402


def test_dry_run_lists_steps_and_collects_gpu_tests():
    """The shell entry point with this interpreter (the GPU machine uses its own python3). ~10 s: pytest's
    collection of the GPU test files in a subprocess."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "would run (pytest" in done.stdout and "would run (bench" in done.stdout
    assert "tests/test_gpu_e2e.py::test_cuda_graph_replay_equals_eager[triton-smollm2]" in done.stdout
    assert "tests/plugins/attention/test_triton.py::test_gpu_conformance_float32[16]" in done.stdout
    assert "tests/plugins/attention/test_triton_tree.py::test_gpu_greedy_tree_output_equals_transformers[eagle-dynamic]" \
        in done.stdout  # tree attention in the compiled kernel
    count = int(done.stdout.rsplit("collected ", 1)[1].split()[0])
    assert count >= 20


def test_pytest_counts(tmp_path):
    junit = tmp_path / "pytest.xml"
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                     '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
                     '<testcase classname="t" name="c"><skipped/></testcase></testsuite></testsuites>')
    assert gpu_check.pytest_counts(junit) == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                              "failed": ["t::b"]}
    assert gpu_check.pytest_counts(tmp_path / "missing.xml") == {}


def test_run_writes_env_pytest_bench_and_summary(tmp_path, monkeypatch):
    """The whole run on CPU with stand-ins for the long parts (stories260K for the random SmolLM2, one GPU
    test, a one-batch benchmark of ``torch``). ~15 s: pytest and the benchmark run as subprocesses."""
    monkeypatch.setattr(gpu_check, "random_smollm2", lambda out_dir: STORIES)
    monkeypatch.setattr(gpu_check, "GPU_TESTS", ["tests/test_gpu_e2e.py::test_greedy_equals_transformers"])
    monkeypatch.setattr(gpu_check, "BENCH_ARGS", ["--dtype", "float32", "--batch-sizes", "1", "--input-len", "8",
                                                  "--output-len", "2", "--repeats", "1", "--backends", "torch"])
    assert gpu_check.main([str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"env.json", "pytest.xml", "bench_attention.json",
                                                   "gpu_check.json", "gpu_check.log"}
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["ok"] and summary["pytest"]["tests"] == summary["pytest"]["skipped"] == 8  # 4 backends x 2 models
    assert summary["bench"]["kernel"][0]["backend"] == "torch" and summary["environment"]["torch"]
    assert "===== bench: exit 0" in (tmp_path / "gpu_check.log").read_text()
