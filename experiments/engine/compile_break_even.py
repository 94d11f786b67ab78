"""Where ``engine.compile`` pays: the warm-up, cold and cached, against the time it saves per token.

``engine.compile=auto`` compiles offline work when its expected saving exceeds the expected warm-up, from
numbers it measures itself (``framework/compilation/calibration.py``). This measures the same
quantities end to end, on this machine, to check the rule's inputs and its priors:

1. **warm-up, cold**: a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` set to
   a new temporary folder) builds ``LLM(compile=True)``; ``compile_s`` is its warm-up (every graph
   compiled from scratch, what a fresh clone pays once).
2. **warm-up, cached**: a second fresh process with the same cache folder does the same (what every
   later run pays: dynamo still traces, inductor loads its compiled code from disk).
3. **saving per token**: in that second process, one eager and one compiled engine each generate
   ``--batch-sizes`` prompts x ``--output-len`` tokens (greedy, ``ignore_eos``, prefix caching off),
   alternating over ``--rounds``; seconds per output token are medians over rounds, prefill included.

Break-even at batch ``b`` = warm-up seconds / (eager - compiled seconds per token at ``b``), printed for
the cold and the cached warm-up. The two warm-ups need fresh processes; everything else runs in the
second one::

    .venv/bin/python -m experiments.engine.compile_break_even --model smollm2 --batch-sizes 1,64 --threads 2 \\
        --json-out break_even.json
    # tensor parallelism: every rank compiles one layer kind (per-rank kinds and graphs in the JSON)
    .venv/bin/python -m experiments.engine.compile_break_even --model smollm2 --dtype bfloat16 --tensor-parallel-size 3 \\
        --batch-sizes 1 --output-len 24 --rounds 1
    # smoke (tiny model, seconds):
    .venv/bin/python -m experiments.engine.compile_break_even --model models/stories260K --batch-sizes 1,4 \\
        --output-len 8 --input-len 16 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT


def build_llm(args: argparse.Namespace, compile: bool) -> Any:
    """``LLM`` for the measurement: ``--model``/``--dtype``, prefix caching off, compiled or eager;
    ``--tensor-parallel-size`` > 1 shards it over that many ``mp`` worker processes."""
    from framework import LLM

    parallel = ({"executor": "mp", "tensor_parallel_size": args.tensor_parallel_size}
                if args.tensor_parallel_size > 1 else {})
    return LLM(model=args.model, dtype=args.dtype, compile=compile, enable_prefix_caching=False, **parallel)


def rank_stats(llm: Any) -> list[Any]:
    """Every rank's ``CompileStats`` (one for an in-process engine)."""
    return llm.engine.executor.collective_rpc("compile_stats")


def prompts_for(llm: Any, batch: int, input_len: int) -> list[list[int]]:
    """``batch`` prompts of ``input_len`` token ids each (``data/prompts.txt`` lines, repeated to length)."""
    tok = llm.get_tokenizer()
    lines = [line for line in (REPO_ROOT / "data" / "prompts.txt").read_text().splitlines() if line.strip()]
    out = []
    for i in range(batch):
        ids: list[int] = []
        j = i
        while len(ids) < input_len:
            ids += tok(lines[j % len(lines)]).input_ids
            j += 1
        out.append(ids[:input_len])
    return out


def seconds_per_token(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    """Wall seconds of one greedy generate over its output tokens (prefill included)."""
    from framework import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return (time.perf_counter() - t0) / sum(len(o.outputs[0].token_ids) for o in outs)


def child_warm_up(args: argparse.Namespace) -> dict[str, Any]:
    """In this (fresh) process: build the compiled engine; with ``--measure``, also time eager vs
    compiled per batch size. Returns the JSON the parent reads."""
    compiled = build_llm(args, compile=True)
    ranks = rank_stats(compiled)
    stats = ranks[0]
    result: dict[str, Any] = {"warm_up_s": stats.compile_s, "graphs": stats.num_graphs_warmup,
                              "active": stats.active, "fallback": stats.fallback_reason,
                              "ranks": [{"warm_up_s": s.compile_s, "layer_kinds": s.num_layer_kinds,
                                         "graphs": s.num_graphs_warmup, "cache_misses": s.num_cache_misses}
                                        for s in ranks]}
    if not args.measure:
        compiled.engine.shutdown()
        return result
    eager = build_llm(args, compile=False)
    per_batch = {}
    for batch in args.batch_sizes:
        prompts = prompts_for(eager, batch, args.input_len)
        for llm in (eager, compiled):  # warm both on this shape (the compiled graphs are already built)
            seconds_per_token(llm, prompts[:1], 2)
        runs: dict[str, list[float]] = {"eager": [], "compiled": []}
        for r in range(args.rounds):
            order = [("eager", eager), ("compiled", compiled)][:: 1 if r % 2 == 0 else -1]
            for name, llm in order:
                runs[name].append(seconds_per_token(llm, prompts, args.output_len))
        per_batch[batch] = {name: statistics.median(v) for name, v in runs.items()} | {"rounds": runs}
    result["per_batch"] = per_batch
    result["recompiles"] = max(s.num_recompiles for s in rank_stats(compiled))
    for llm in (eager, compiled):
        llm.engine.shutdown()
    return result


def run_child(args: argparse.Namespace, cache_dir: str, measure: bool) -> dict[str, Any]:
    """Run :func:`child_warm_up` in a new process with ``TORCHINDUCTOR_CACHE_DIR=cache_dir``.

    Raises:
        RuntimeError: the child failed (its stderr tail in the message).
    """
    argv = [sys.executable, "-m", "experiments.engine.compile_break_even", "--child", "--model", args.model,
            "--dtype", args.dtype,
            "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--rounds", str(args.rounds), "--threads", str(args.threads),
            "--tensor-parallel-size", str(args.tensor_parallel_size)]
    if measure:
        argv.append("--measure")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"compile_break_even child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def break_even(cold: dict[str, Any], cached: dict[str, Any]) -> dict[int, dict[str, float | None]]:
    """Per batch size: eager and compiled ms/token, the saving, and the break-even in tokens for the
    cold and the cached warm-up (``None`` where compiling saves nothing)."""
    out = {}
    for batch, t in cached["per_batch"].items():
        saved = t["eager"] - t["compiled"]
        out[int(batch)] = {"eager_ms_per_token": 1e3 * t["eager"], "compiled_ms_per_token": 1e3 * t["compiled"],
                           "saved_ms_per_token": 1e3 * saved,
                           "break_even_tokens_cold": cold["warm_up_s"] / saved if saved > 0 else None,
                           "break_even_tokens_cached": cached["warm_up_s"] / saved if saved > 0 else None}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating eager/compiled generates per batch size")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in the children; 0 = default")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="> 1: executor=mp over that many ranks")
    p.add_argument("--json-out", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(child_warm_up(args)))
        return {}
    with tempfile.TemporaryDirectory(prefix="inductor-break-even-") as cache_dir:
        cold = run_child(args, cache_dir, measure=False)
        cached = run_child(args, cache_dir, measure=True)
    table = break_even(cold, cached)
    print(f"model={args.model} dtype={args.dtype} input_len={args.input_len} output_len={args.output_len} "
          f"rounds={args.rounds} tensor_parallel_size={args.tensor_parallel_size}")
    print(f"warm-up: cold {cold['warm_up_s']:.1f} s, cached {cached['warm_up_s']:.1f} s ({cold['graphs']} graphs; "
          f"{cached['recompiles']} recompiles while measuring)" + (f"; FELL BACK: {cold['fallback']}"
                                                                    if cold["fallback"] else ""))
    if args.tensor_parallel_size > 1:
        print("per rank, layer kinds / warm-up graphs / warm-up s cold, cached: " + "; ".join(
            f"{c['layer_kinds']} / {c['graphs']} / {c['warm_up_s']:.1f}, {w['warm_up_s']:.1f}"
            for c, w in zip(cold["ranks"], cached["ranks"], strict=True)))
    print(f"{'batch':>6}{'eager ms/tok':>14}{'compiled ms/tok':>17}{'saved ms/tok':>14}"
          f"{'break-even tokens cold':>24}{'cached':>10}")
    for batch, row in table.items():
        cells = [f"{row[k]:>{w},.0f}" if row[k] is not None else f"{'never':>{w}}"
                 for k, w in (("break_even_tokens_cold", 24), ("break_even_tokens_cached", 10))]
        print(f"{batch:>6}{row['eager_ms_per_token']:>14.3f}{row['compiled_ms_per_token']:>17.3f}"
              f"{row['saved_ms_per_token']:>14.3f}{cells[0]}{cells[1]}")
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "measure")}, "cold": cold,
              "cached": cached, "break_even": table}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
