"""Would splitting a step's batch over the two cores beat one batch on two OpenMP threads? (CPU, issue 8)

A decode step's two OpenMP threads wait on each other: the worker idles while the main thread does
the step's host work (docs/results.md, fifteenth pass). Splitting the batch into one nano-batch per
core, each on one OpenMP thread, removes the barrier (the nano-batch idea of NanoFlow, Zhu et al.
2024, Sec. 4, applied to cores instead of GPU units). Two measurements bound what that could gain:

``threads``: one process per setting, the compiled engine's dummy decode forward
(``ModelRunner._dummy_forward``, ``--rows`` decode rows, short contexts, one sampled row). ``whole``:
``2 * rows`` rows on 2 OpenMP threads. ``split``: graphs compiled for 1 thread, then ``rows`` rows
twice, one after the other and in two Python threads at once (same process, shared weights and
cache; the generated kernels hold the GIL, oneDNN's GEMMs release it). Prints ms per ``2 * rows``
rows for each.

``dp``: the ceiling of any in-engine split: two whole engines, one per core (``sched_setaffinity``),
each on its half of the workload with 1 thread, started together per round; against one engine on
both cores with 2 threads and every prompt. Each round's throughput is the output tokens over the
slower shard's seconds. Nothing is shared, so this also parallelises the engines' own host work,
which an in-engine split would not.

    .venv/bin/python -m experiments.studies.nano_batch_cpu threads --rows 32
    .venv/bin/python -m experiments.studies.nano_batch_cpu dp --workload fixed --num-prompts 64 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT, add_model_workload_args, load_workload, set_thread_env
from experiments.offline.bench_vs_vllm import servelab_llm


def engine(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[Any, Any]:
    """servelab's ``LLM`` as the benchmarks run it (paged in-place attention, prefix caching on,
    compiled unless ``--eager``) and its ``generate`` (``bench_vs_vllm.servelab_llm``)."""
    return servelab_llm(args.model, args.dtype, "torch_paged", True, not args.eager, prompts)


def wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    """Block until every file in ``paths`` exists.

    Raises:
        RuntimeError: one of ``procs`` failed (exited with a non-zero code) before that. A shard that
            exits with 0 has written its last file already.
    """
    while not all(path.exists() for path in paths):
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a dp engine failed; run its command alone to see why")
        time.sleep(0.005)


def child_threads(setting: str, args: argparse.Namespace) -> dict[str, float]:
    """One ``threads`` setting in this process: ``{"whole"}`` or ``{"sequential", "two_threads"}``,
    median ms per ``2 * rows`` decode rows over ``--rounds`` rounds of ``--steps`` forwards."""
    import torch

    torch.set_num_threads(2 if setting == "whole" else 1)
    runner = engine(args, [[1] * 16] * 2)[0].engine.runner
    rows = args.rows

    def forward(n: int) -> None:
        torch.set_num_threads(2 if setting == "whole" else 1)  # per thread: OpenMP's thread count is per thread
        for _ in range(args.steps):
            runner._dummy_forward(n, n)

    def timed(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) / args.steps * 1e3)
        return statistics.median(times)

    if setting == "whole":
        forward(2 * rows)  # warm-up
        return {"whole": timed(lambda: forward(2 * rows))}

    def two_threads() -> None:
        workers = [threading.Thread(target=forward, args=(rows,)) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    forward(rows)
    return {"sequential": timed(lambda: (forward(rows), forward(rows))), "two_threads": timed(two_threads)}


def child_dp(args: argparse.Namespace) -> None:
    """One ``dp`` engine: its shard of the workload, one repeat per ``go<r>`` file in ``--sync``;
    prints ``RESULT`` with each round's seconds."""
    import torch

    torch.set_num_threads(args.threads)
    _, _, prompts, lens = load_workload(args)
    order = sorted(range(len(prompts)), key=lambda i: -lens[i])[args.shard::args.num_shards]  # balanced by length
    prompts, lens = [prompts[i] for i in order], [lens[i] for i in order]
    llm, generate = engine(args, prompts)
    sync = Path(args.sync)
    (sync / f"ready{args.shard}").touch()
    seconds = []
    for r in range(args.rounds):
        while not (sync / f"go{r}").exists():
            time.sleep(0.002)
        llm.engine.scheduler.kv.reset_prefix_cache()
        seconds.append(generate(prompts, lens)[0])
        (sync / f"done{args.shard}_{r}").touch()
    print("RESULT " + json.dumps({"tokens": sum(lens), "seconds": seconds}), flush=True)


def run_dp(args: argparse.Namespace, shards: int, threads: int) -> list[float]:
    """``shards`` engines (each pinned to one core when ``shards > 1``) started together per round;
    returns each round's output tok/s (all shards' tokens / the slowest shard's seconds)."""
    with tempfile.TemporaryDirectory() as sync:
        base = [sys.executable, "-m", "experiments.studies.nano_batch_cpu", "dp-child", "--sync", sync,
                "--threads", str(threads),
                "--num-shards", str(shards), "--rounds", str(args.rounds), "--model", args.model, "--dtype", args.dtype,
                "--workload", args.workload, "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--min-output-len", str(args.min_output_len),
                "--max-output-len", str(args.max_output_len), "--seed", str(args.seed), "--prompts-file", args.prompts_file]
        base += ["--eager"] if args.eager else []
        procs, cores = [], os.cpu_count() or 1
        for s in range(shards):
            pin = (lambda c=s % cores: os.sched_setaffinity(0, {c})) if shards > 1 else None
            procs.append(subprocess.Popen([*base, "--shard", str(s)], stdout=subprocess.PIPE, text=True,
                                          preexec_fn=pin, cwd=REPO_ROOT))
        try:
            wait_for([Path(sync) / f"ready{s}" for s in range(shards)], procs)
            for r in range(args.rounds):
                (Path(sync) / f"go{r}").touch()
                wait_for([Path(sync) / f"done{s}_{r}" for s in range(shards)], procs)
            results = [json.loads(next(line for line in p.communicate()[0].splitlines()
                                       if line.startswith("RESULT ")).removeprefix("RESULT ")) for p in procs]
        finally:  # a shard that failed leaves the others polling for go files that never come
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    tokens = sum(r["tokens"] for r in results)
    return [tokens / max(r["seconds"][i] for r in results) for i in range(args.rounds)]


def main(argv: list[str] | None = None) -> dict:
    """Run ``threads`` or ``dp`` (each setting in its own processes); returns what it printed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", choices=("threads", "dp", "threads-child", "dp-child"))
    add_model_workload_args(p)
    p.add_argument("--rows", type=int, default=32, help="threads: decode rows per nano-batch")
    p.add_argument("--steps", type=int, default=10, help="threads: forwards per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="engine.compile off (tests; the measurement compiles)")
    p.add_argument("--setting", default="whole", help=argparse.SUPPRESS)
    p.add_argument("--sync", default="", help=argparse.SUPPRESS)
    p.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--num-shards", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    set_thread_env(args.threads)  # before torch loads: this process's and its children's OpenMP/MKL
    if args.bench == "threads-child":
        print("RESULT " + json.dumps(child_threads(args.setting, args)), flush=True)
        return {}
    if args.bench == "dp-child":
        child_dp(args)
        return {}
    if args.bench == "dp":
        out = {"one engine, 2 threads": run_dp(args, 1, 2), "two engines, 1 core each": run_dp(args, 2, 1)}
        for name, tok_s in out.items():
            print(f"{name:<26} tok/s median {statistics.median(tok_s):7.1f}   rounds {' '.join(f'{x:.1f}' for x in tok_s)}")
        return out
    out = {}
    for setting in ("whole", "split"):
        cmd = [sys.executable, "-m", "experiments.studies.nano_batch_cpu", "threads-child", "--setting", setting,
               "--model", args.model, "--dtype", args.dtype, "--rows", str(args.rows), "--steps", str(args.steps),
               "--rounds", str(args.rounds)] + (["--eager"] if args.eager else [])
        env = {**os.environ, "OMP_NUM_THREADS": "2" if setting == "whole" else "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"threads-child {setting} failed:\n{proc.stderr[-3000:]}")
        out.update(json.loads(lines[-1].removeprefix("RESULT ")))
    print(f"{2 * args.rows} decode rows: one forward on 2 OpenMP threads {out['whole']:.1f} ms | "
          f"two {args.rows}-row forwards on 1 thread: one after the other {out['sequential']:.1f} ms, "
          f"in two Python threads {out['two_threads']:.1f} ms")
    return out


if __name__ == "__main__":
    main()
