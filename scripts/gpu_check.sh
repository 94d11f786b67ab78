#!/usr/bin/env bash
# servelab's whole GPU verification in one command (issue 47; details: scripts/gpu_check.py):
#   bash scripts/gpu_check.sh [OUT_DIR]     on a CUDA machine: env, pytest -m gpu, bench -> OUT_DIR (default $OUT)
#   bash scripts/gpu_check.sh --dry-run     anywhere: list the steps, check pytest collects the GPU tests
#   bash scripts/gpu_check.sh --prepare     here, before a GPU call: fill .gpu_bundle/ (carry it with the tree)
# Runs with the machine's python3 (PYTHON=... to override) and the repo on PYTHONPATH; finishes in <= 8 min.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
for arg in "$@"; do
    if [[ "$arg" == "--prepare" && -z "${PYTHON:-}" && -x "$REPO/.venv/bin/python" ]]; then
        PY="$REPO/.venv/bin/python"  # the bundle is copied from this checkout's environment
    fi
done
export PYTHONPATH="$REPO/.gpu_bundle/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PY" "$REPO/scripts/gpu_check.py" "$@"
