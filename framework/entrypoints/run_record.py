"""Reproducibility record of a run (``run_record.json`` in the run dir, ``servelab_run.*`` in the W&B config):
what ran (resolved config, plugin packages and versions), on what (versions, device, threads), with which seeds."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework import registry
from framework.config import PLUGIN_FIELDS
from framework.entrypoints.hydra_config import REPO_ROOT
from framework.entrypoints.plugin_info import chosen_plugin_sources
from framework.platform import cpu_isa

RECORD_FILE = "run_record.json"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"sha": str | None, "dirty": bool | None}`` of the servelab checkout (``None`` outside git)."""
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha.strip() if sha else None, "dirty": None if status is None else bool(status.strip())}


def sweep_group() -> str | None:
    """The sweep's name in a Hydra multirun (``multirun/2026-01-01/12-00-00`` -> ``2026-01-01_12-00-00``,
    i.e. the sweep dir's last two path parts), ``None`` in a single run or outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    parts = Path(HydraConfig.get().sweep.dir).parts
    return "_".join(parts[-2:]) if len(parts) >= 2 else parts[-1]


def build_run_record(cfg: DictConfig, engine_config: Any) -> dict[str, Any]:
    """The record as a JSON-able dict.

    Keys: ``servelab`` (version, git sha, dirty), ``plugins`` (per kind: name, package, version,
    class), ``versions`` (python, torch, transformers, hydra-core, pluggy), ``device``,
    ``threads`` (torch intra-op threads, ``OMP_NUM_THREADS``), ``seeds`` (engine, sampling,
    workload), ``platform``, ``argv`` and ``sweep_group``; ``config`` is the resolved run config.
    """
    import torch

    choices = {kind: getattr(engine_config, kind) for kind in PLUGIN_FIELDS}
    if cfg.get("tracker") is not None:
        choices["tracker"] = cfg.tracker.name
    return {
        "servelab": {"version": _version("servelab"), **git_state()},
        "plugins": chosen_plugin_sources({k: v for k, v in choices.items() if k in registry.KINDS}),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": _version("transformers"), "hydra-core": _version("hydra-core"),
                     "pluggy": _version("pluggy")},
        "device": {"name": str(engine_config.device),
                   "cuda": torch.cuda.get_device_name() if str(engine_config.device).startswith("cuda") else None,
                   "cpu": cpu_isa().summary(), "dtype": str(engine_config.dtype)},
        "threads": {"torch": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "seeds": {"engine": cfg.get("seed"), "sampling": cfg.get("sampling", {}).get("seed"),
                  "workload": cfg.get("workload", {}).get("seed")},
        "platform": platform.platform(),
        "argv": list(sys.argv),
        "sweep_group": sweep_group(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def write_run_record(run_dir: str | Path, cfg: DictConfig, engine_config: Any) -> dict[str, Any]:
    """Build the record and write it to ``RUN_DIR/run_record.json``; returns it."""
    record = build_run_record(cfg, engine_config)
    (Path(run_dir) / RECORD_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record
