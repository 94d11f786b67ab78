"""``scripts/gpu_check.sh``: its dry run works on a machine without CUDA (lists the steps, and pytest
collects the GPU tests), so a GPU session loses no minutes to a broken script; the junit summary parses."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO

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
