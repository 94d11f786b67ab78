"""The example third-party package (examples/servelab-plugin-example): pip-installed into this environment,
``run.py`` selects its scheduler and allocator, its own conformance tests pass; uninstalled, the choice is
gone with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from helpers import EAGER_KERNEL, STORIES

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "servelab-plugin-example"


def pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "SERVELAB_TEST_MODEL": STORIES}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


def test_example_package_installs_runs_passes_conformance_and_uninstalls_cleanly(tmp_path):
    pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    try:
        proc = run("run.py", "model=stories260K", "scheduler=lifo", "kv_cache=peak_paged", "tracker=none",
                   "workload.limit=3", "sampling.max_tokens=4", EAGER_KERNEL, f"hydra.run.dir={tmp_path / 'run'}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        record = json.loads((tmp_path / "run" / "run_record.json").read_text())
        assert record["plugins"]["scheduler"]["name"] == "lifo"
        assert record["plugins"]["scheduler"]["package"] == "servelab-plugin-example"
        assert record["plugins"]["kv_allocator"]["class"].endswith("PeakPagedKVAllocator")
        # its Hydra defaults on the search path, no file copied here (the run's record of ``--info searchpath``)
        hydra_yaml = yaml.safe_load((tmp_path / "run" / ".hydra" / "hydra.yaml").read_text())
        sources = hydra_yaml["hydra"]["runtime"]["config_sources"]
        assert {"path": "servelab_plugin_example.conf", "schema": "pkg", "provider": "servelab-plugin-example"} in sources
        tests = run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests"), cwd=tmp_path)
        assert tests.returncode == 0, tests.stdout[-3000:]
    finally:
        pip("uninstall", "-y", "servelab-plugin-example")
    proc = run("run.py", "model=stories260K", "scheduler=lifo", "tracker=none", f"hydra.run.dir={tmp_path / 'gone'}")
    assert proc.returncode != 0 and "lifo" in proc.stderr and "fcfs" in proc.stderr
