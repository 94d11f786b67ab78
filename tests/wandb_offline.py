"""Check an offline W&B run file (``run-*.wandb``) for tests. This wandb release ships no public
reader for the file, so the checks look for the protobuf-encoded strings (stored uncompressed)."""

from __future__ import annotations

from pathlib import Path


def offline_run_bytes(run_dir: Path) -> bytes:
    """Raw bytes of the single offline run file under ``run_dir/wandb``."""
    (path,) = list(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    return path.read_bytes()
