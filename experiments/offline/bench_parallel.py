"""Tensor-parallel overhead on CPU: TP=1 on all threads vs TP=2 on one thread per rank (``mp`` with
the default shared-memory collectives, ``mp`` with gloo's (``parallel.communicator=torch_distributed``:
``mp2_gloo``), and ``ray`` where installed) vs transformers' own ``tp_plan="auto"`` under ``torchrun`` (where it runs:
it needs ``accelerate``, not a servelab dependency; without it the row reports that error).

The model is SmolLM2-135M's shape with 8 query and 4 KV heads (so TP=2 divides them; SmolLM2 has
9 and 3) and random weights, bf16, written once to ``--model-dir`` (the tokenizer is SmolLM2's when
its package is installed, else stories260K's; prompts are random token ids, so it does not matter).

Per system and batch size (``--batches``, default 1 and 64): output tok/s of a whole ``generate``
(``ignore_eos``, ``--output-len`` tokens, ``--prompt-len``-token prompts), ITL p50/p99, and a
decode-only window (every request past its prefill, ``--window`` engine steps) that splits a decode
step into: the step broadcast and reply (the executor's ``execute_model`` wall time minus the
driver rank's own prepare + forward + sample time), and the collectives (``Worker.enable_collective_timing``:
``torch.distributed`` calls timed on rank 0). On 2 cores no speed-up is expected; the goal is the
overhead: broadcast + collectives under 15% of a batch-64 decode step.

Example (the measured pass, quiet machine)::

    .venv/bin/python -m experiments.offline.bench_parallel --json-out experiments/results/parallel.json
    .venv/bin/python -m experiments.offline.bench_parallel --tiny --batches 1 4 --output-len 8   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT
from framework.metrics.collector import percentile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=8, vocab_size=512, max_position_embeddings=512,
                  tie_word_embeddings=True)
SYSTEMS = ("tp1", "mp2", "mp2_gloo", "ray2", "hf_tp2")


def make_model(folder: Path, tiny: bool, dtype: str) -> Path:
    """Write the random-weight model (and a tokenizer) to ``folder`` once; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY_SHAPE if tiny else SMOLLM2_SHAPE), bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer_src = REPO_ROOT / "models" / "stories260K"
    if not tiny:
        try:
            from framework.model_executor.model_loader import resolve_model_path

            tokenizer_src = Path(resolve_model_path("smollm2"))
        except (ImportError, FileNotFoundError, ModuleNotFoundError):
            pass
    for f in tokenizer_src.glob("tokenizer*"):
        shutil.copy(f, folder / f.name)
    for f in ("special_tokens_map.json",):
        if (tokenizer_src / f).is_file():
            shutil.copy(tokenizer_src / f, folder / f)
    return folder


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` random token-id prompts of ``length`` tokens (ids 3..vocab-1)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def itl_ms(itl_s: list[float]) -> dict[str, float]:
    """ITL p50 and p99 in ms (the engine's percentile); NaN each when there is no interval (one output token)."""
    if not itl_s:
        return {"itl_p50_ms": float("nan"), "itl_p99_ms": float("nan")}
    return {"itl_p50_ms": 1e3 * percentile(itl_s, 50), "itl_p99_ms": 1e3 * percentile(itl_s, 99)}


def decode_window(llm: Any, batch: list[list[int]], output_len: int, window: int) -> dict[str, float]:
    """Step the engine past every prefill, then time ``window`` decode-only steps; returns per-step
    means (ms) of the step, the broadcast + reply, and rank 0's collectives (and their count: one
    all-reduce for the embedding, two per layer, one gather of the logits under TP=2)."""
    from framework import SamplingParams

    engine, executor = llm.engine, llm.engine.executor
    for i, ids in enumerate(batch):
        engine.add_request(f"w{i}", ids, SamplingParams(temperature=0.0, max_tokens=output_len + window + 2,
                                                        ignore_eos=True))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    overhead: list[float] = []
    execute = executor.execute_model

    def timed(scheduler_output: Any) -> Any:
        t0 = time.perf_counter()
        out = execute(scheduler_output)
        overhead.append(time.perf_counter() - t0 - (out.prepare_s + out.forward_s + out.sample_s))
        return out

    executor.execute_model = timed
    before = executor.collective_rpc("collective_times", unique_reply_rank=0)[0]
    t0 = time.perf_counter()
    for _ in range(window):
        engine.step()
    step_s = (time.perf_counter() - t0) / window
    after = executor.collective_rpc("collective_times", unique_reply_rank=0)[0]
    executor.execute_model = execute
    engine.abort_request(list(engine.scheduler.requests))
    collective_s = (after["collective_s"] - before["collective_s"]) / window
    broadcast_s = statistics.fmean(overhead)
    return {"decode_step_ms": 1e3 * step_s, "broadcast_ms": 1e3 * broadcast_s, "collective_ms": 1e3 * collective_s,
            "collectives_per_step": (after["num_collectives"] - before["num_collectives"]) / window,
            "broadcast_share": broadcast_s / step_s, "collective_share": collective_s / step_s,
            "overhead_share": (broadcast_s + collective_s) / step_s}


def run_servelab(system: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One servelab system: ``tp1`` (uniproc, all threads), ``mp2``/``mp2_gloo``/``ray2`` (two ranks,
    1 thread each; ``mp2_gloo`` with ``parallel.communicator=torch_distributed``)."""
    from framework import LLM, SamplingParams

    cores = len(os.sched_getaffinity(0))
    tp = 1 if system == "tp1" else 2
    executor = {"tp1": "uniproc", "mp2": "mp", "mp2_gloo": "mp", "ray2": "ray"}[system]
    llm = LLM(model=str(model), dtype=args.dtype, executor=executor, tensor_parallel_size=tp,
              num_threads_per_rank=cores // tp, grammar="none", enable_prefix_caching=False,
              max_num_seqs=max(args.batches), max_num_batched_tokens=max(2048, args.prompt_len * max(args.batches)),
              max_model_len=args.prompt_len + args.output_len + args.window + 8,
              attention=args.attention, num_blocks=args.num_blocks,
              communicator="torch_distributed" if system == "mp2_gloo" else "auto",
              executor_params={"num_cpus_per_worker": 1.0} if executor == "ray" else {})
    try:
        llm.engine.executor.collective_rpc("enable_collective_timing")
        vocab = llm.engine.vocab_size
        llm.generate(prompts(2, 8, vocab, seed=1), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        out: dict[str, Any] = {"system": system, "tensor_parallel_size": tp, "threads_per_rank": cores // tp}
        for batch in args.batches:
            ids = prompts(batch, args.prompt_len, vocab)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                                SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
            elapsed = time.perf_counter() - t0
            itl = [x for o in outs for x in o.metrics.itl_s]
            out[f"b{batch}"] = {"output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
                                **itl_ms(itl),
                                **decode_window(llm, ids, args.output_len, args.window)}
        return out
    finally:
        llm.engine.shutdown()


def hf_worker(args: argparse.Namespace) -> None:
    """Runs under ``torchrun``: transformers ``tp_plan="auto"``, greedy ``generate``, rank 0 prints JSON."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("WORLD_SIZE", "1"))))
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype), tp_plan="auto")
    vocab, out = model.config.vocab_size, {"system": "hf_tp2"}

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.perf_counter())
            return scores

    for batch in args.batches:
        ids = torch.tensor(prompts(batch, args.prompt_len, vocab))
        stamp = Stamp()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.output_len,
                           min_new_tokens=args.output_len, do_sample=False, logits_processor=LogitsProcessorList([stamp]))
        elapsed = time.perf_counter() - t0
        itl = [b - a for a, b in zip(stamp.times, stamp.times[1:])]
        out[f"b{batch}"] = {"output_tok_s": batch * args.output_len / elapsed, **itl_ms(itl)}
    if dist.get_rank() == 0:
        print("HF_RESULT " + json.dumps(out), flush=True)


def run_hf(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """transformers' own tensor parallelism under ``torchrun --nproc-per-node 2`` (gloo on CPU)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "-m", "experiments.offline.bench_parallel", "--hf-worker",
           "--model-dir", str(model),
           "--dtype", args.dtype, "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
           "--batches", *map(str, args.batches)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.hf_timeout_s, cwd=REPO_ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("HF_RESULT "):
            return json.loads(line.removeprefix("HF_RESULT "))
    errors = [line for line in (proc.stderr + proc.stdout).splitlines() if "Error:" in line]
    return {"system": "hf_tp2", "error": errors[0] if errors else (proc.stderr or proc.stdout).strip()[-500:]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/servelab-bench-parallel"))
    p.add_argument("--tiny", action="store_true", help="2-layer 64-wide model (smoke tests)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: what dtype=auto runs a bf16 checkpoint in on this CPU (float32 on AVX2 only)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--attention", default="torch_paged", help="attention backend (default: the CPU default)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per rank (default: the 1 GiB budget)")
    p.add_argument("--window", type=int, default=16, help="decode steps timed in the decode-only window")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--hf-timeout-s", type=float, default=1800)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtype == "auto":
        from framework.platform import choose_dtype

        args.dtype = choose_dtype("auto", "bfloat16", "cpu").dtype
    if args.hf_worker:
        hf_worker(args)
        return {}
    model = make_model(args.model_dir / ("tiny" if args.tiny else "smollm2-8h"), args.tiny, args.dtype)
    results = []
    for system in args.systems:
        if system == "ray2" and importlib_missing("ray"):
            results.append({"system": system, "skipped": "ray is not installed (pip install 'servelab[ray]')"})
        elif system == "hf_tp2":
            results.append(run_hf(model, args))
        else:
            results.append(run_servelab(system, model, args))
        print(json.dumps(results[-1]), flush=True)
    report = {"model": str(model), "dtype": args.dtype, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "cores": len(os.sched_getaffinity(0)), "results": results}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


if __name__ == "__main__":
    main()
