"""Offline data parallelism: ``LLM(model, data_parallel_size=N)`` against one engine on the same cores (issue 49).

Each system runs the same greedy batch (``--num-prompts`` random-token prompts of ``--prompt-len`` tokens,
``--output-len`` output tokens each, ``ignore_eos``) ``--repeats`` times after one warm-up call, in a process of its
own (so each starts from the same machine state), and reports output tok/s (median) and whether its greedy tokens
equal the single engine's. Systems: ``dp1`` (one engine, every core, ``executor=auto`` = uniproc), ``dpN`` (N CPU
replicas: ``executor=auto`` = each replica's rank in a worker process pinned to its ``replica_cpus``, the replicas
stepping at once), ``dpN-turns`` (N replicas with ``executor=uniproc``: one process, taking turns). Every system runs
eager (``compile=False``): the comparison is of the parallel layout, not of compilation.

Example (2-core AMD EPYC, SmolLM2-135M bf16)::

    .venv/bin/python -m experiments.offline.bench_offline_dp --json-out docs/results/parallel/offline_dp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT, bench_dtype

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_system(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One system's repeats in this process: ``{"tok_s": [...], "tokens": [[ids]...]}``."""
    import random

    from framework import LLM, SamplingParams

    n = args.replicas
    kwargs: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "compile": False}
    if name != "dp1":
        kwargs.update(data_parallel_size=n, router="round_robin")
    if name.endswith("-turns"):
        kwargs["executor"] = "uniproc"
    llm = LLM(**kwargs)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    tok_s, tokens = [], []
    for r in range(args.repeats):
        batch = [[(t + 7919 * (r + 1)) % 20000 + 100 for t in p] for p in prompts]  # fresh prompts: no prefix hits
        start = time.perf_counter()
        outputs = llm.generate(batch, params)
        elapsed = time.perf_counter() - start
        tok_s.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    llm.engine.shutdown()
    return {"system": name, "tok_s": tok_s, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", help="auto: the dtype servelab's dtype=auto picks on this CPU (float32 for bf16 on AVX2 only)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--systems", default=None, help="comma list (default: dp1,dpN,dpN-turns)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one system, print its JSON
    args = p.parse_args()
    args.dtype = bench_dtype(args.model, args.dtype)
    if args.one:
        print("RESULT " + json.dumps(run_system(args, args.one)))
        return
    n = args.replicas
    systems = args.systems.split(",") if args.systems else ["dp1", f"dp{n}", f"dp{n}-turns"]
    results = []
    for name in systems:
        cmd = [sys.executable, "-m", "experiments.offline.bench_offline_dp", "--one", name, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    base = results[0]
    from framework.platform import cpu_name

    print(f"{args.model} {args.dtype}, {args.num_prompts} x {args.prompt_len} -> {args.output_len}, "
          f"{os.cpu_count()} cores ({cpu_name()})")
    rows = []
    for res in results:
        median = statistics.median(res["tok_s"])
        same = sum(a == b for a, b in zip(res["tokens"][0], base["tokens"][0]))
        rows.append({"system": res["system"], "tok_s": median, "all_tok_s": res["tok_s"],
                     "vs_dp1": median / statistics.median(base["tok_s"]), "same_tokens_as_dp1": same})
        print(f"{res['system']:<12} {median:8.1f} tok/s  x{rows[-1]['vs_dp1']:.2f} of dp1  "
              f"({' '.join(f'{t:.1f}' for t in res['tok_s'])})  greedy tokens equal dp1's: {same}/{args.num_prompts}")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"args": vars(args), "cpu": cpu_name(), "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
