"""Multi-LoRA throughput: the base model against LoRA backends, adapter counts and ranks, merged weights and the
adapter-grouping scheduler policy, one process per configuration (docs/lora.md).

Every configuration runs the same greedy batch (``--num-prompts`` prompts of ``--input-len`` tokens, exactly
``--output-len`` output tokens each, ``ignore_eos``; all submitted at once) after one warm-up call, and reports
output tok/s, TTFT p50 (ms) and, for LoRA rows, the ratio to the base model's tok/s measured in the same run.
Adapters are random PEFT adapters (``init_lora_weights=False``, then A and B redrawn per adapter with small
values) saved with ``save_pretrained`` under a temporary folder; request ``i`` runs adapter ``i mod N``.

Configurations (``name``: what runs):

* ``base``: the base model, LoRA off (the ceiling);
* ``<backend>_n<N>_r<R>`` for backend in ``--backends`` (bgmv, sgmv, loop), ``N`` in ``--num-adapters``, ``R`` in
  ``--ranks``: ``max_loras = max_cpu_loras = N`` (every adapter in a device slot), ``scheduler=fcfs``;
* ``merged_r<R>``: one adapter merged into the base weights (PEFT's ``merge_and_unload``), LoRA off: a single
  adapter's best case;
* ``<policy>_n<N>_slots<S>`` for policy in ``fcfs``, ``lora_affinity``: ``--affinity-adapters`` adapters through
  ``--affinity-slots`` device slots (``bgmv``, rank ``--affinity-rank``), where grouping requests by adapter pays.

The speed goal (issue 59, SmolLM2 bf16, 64 requests): ``bgmv_n4_r8`` >= 0.75x ``base``, and ``bgmv_n16_r8`` >= 2x
``loop_n16_r8``; ``--quick`` runs only the rows these ratios need (base, bgmv n4 and n16, loop n16, rank 8) and
``bgmv_torch_n16_r8`` (``bgmv`` with ``lora_backend.params.kernel=torch``: the ablation of its C++ kernel).
Sources: Punica (BGMV), S-LoRA (SGMV, many adapters on demand), vLLM's ``benchmarks/benchmark_throughput.py
--enable-lora`` (random adapter per request).

Example (the lead's quiet-machine run)::

    .venv/bin/python -m experiments.offline.bench_lora --json-out docs/results/lora/bench_lora.json
    .venv/bin/python -m experiments.offline.bench_lora --quick
    .venv/bin/python -m experiments.offline.bench_lora --model stories260K --num-prompts 8 --output-len 4 \
        --input-len 16 --quick   # a seconds-long smoke run
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

from experiments.common import REPO_ROOT, add_model_workload_args, code_state, machine_info, markdown_table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def make_adapters(model_path: str, root: Path, num: int, rank: int, targets: list[str], seed: int) -> list[str]:
    """``num`` random PEFT adapters of ``rank`` on ``targets`` for ``model_path``, saved under ``root``
    (``adapter_<i>``); A and B drawn from N(0, 0.02^2) per adapter, ``lora_alpha = 2 * rank``.

    Returns:
        The adapter folders, in order (made once: folders already there, from an earlier configuration, are reused).
    """
    folders = [root / f"adapter_{i}" for i in range(num)]
    if all((f / "adapter_config.json").is_file() for f in folders):
        return [str(f) for f in folders]
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                       init_lora_weights=False))
    gen = torch.Generator().manual_seed(seed)
    for folder in folders:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        model.save_pretrained(folder)
    return [str(f) for f in folders]


def merged_model(model_path: str, adapter: str, out: Path) -> str:
    """``adapter`` merged into the base model's weights (PEFT's ``merge_and_unload``), saved with its tokenizer
    under ``out`` in the checkpoint's dtype; returns the folder."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    dtype = AutoModelForCausalLM.from_pretrained(model_path).dtype
    merged = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload().to(dtype)
    merged.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_path, local_files_only=True).save_pretrained(out)
    return str(out)


def configurations(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The configurations to run, each ``{"name", "kind", ...}`` (see the module docstring)."""
    if args.quick:
        return [{"name": "base", "kind": "base"}] + [
            {"name": f"{b}_n{n}_r8", "kind": "lora", "backend": b, "adapters": n, "rank": 8, "slots": n,
             "scheduler": "fcfs"} for b, n in (("bgmv", 4), ("bgmv", 16), ("loop", 16))] + [
            {"name": "bgmv_torch_n16_r8", "kind": "lora", "backend": "bgmv", "backend_params": {"kernel": "torch"},
             "adapters": 16, "rank": 8, "slots": 16, "scheduler": "fcfs"}]
    rows = [{"name": "base", "kind": "base"}]
    for rank in args.ranks:
        for backend in args.backends:
            rows += [{"name": f"{backend}_n{n}_r{rank}", "kind": "lora", "backend": backend, "adapters": n,
                      "rank": rank, "slots": n, "scheduler": "fcfs"} for n in args.num_adapters]
        rows.append({"name": f"merged_r{rank}", "kind": "merged", "rank": rank})
    n, slots = args.affinity_adapters, args.affinity_slots
    rows += [{"name": f"{policy}_n{n}_slots{slots}", "kind": "lora", "backend": "bgmv", "adapters": n,
              "rank": args.affinity_rank, "slots": slots, "scheduler": policy} for policy in ("fcfs", "lora_affinity")]
    return rows


def run_one(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: ``{"name", "output_tok_s", "ttft_p50_ms", "wall_s", "num_output_tokens"}``.

    Adapters (and the merged model) are made here, under ``args.adapter_dir``, and reused by later processes."""
    from transformers import AutoTokenizer

    from experiments.common import build_workload, load_texts
    from framework import LLM, LoRARequest, SamplingParams
    from framework.model_executor.model_loader import resolve_model_path

    path = resolve_model_path(args.model)
    root = Path(args.adapter_dir)
    kwargs: dict[str, Any] = {"dtype": args.dtype, "enable_prefix_caching": False, "max_num_seqs": args.num_prompts}
    loras: list[Any] = [None] * args.num_prompts
    model = path
    if cfg["kind"] == "lora":
        folders = make_adapters(path, root / f"r{cfg['rank']}_n{cfg['adapters']}", cfg["adapters"], cfg["rank"],
                                args.targets, args.seed)
        requests = [LoRARequest(f"a{i}", i + 1, f) for i, f in enumerate(folders)]
        loras = [requests[i % len(requests)] for i in range(args.num_prompts)]
        kwargs.update(enable_lora=True, max_loras=cfg["slots"], max_cpu_loras=cfg["adapters"],
                      max_lora_rank=cfg["rank"], lora_backend=cfg["backend"], scheduler=cfg["scheduler"],
                      lora_backend_params=cfg.get("backend_params", {}))
    elif cfg["kind"] == "merged":
        folder = make_adapters(path, root / f"merged_r{cfg['rank']}_adapter", 1, cfg["rank"], args.targets,
                               args.seed)[0]
        model = merged_model(path, folder, root / f"merged_r{cfg['rank']}")
    llm = LLM(model=model, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts, _ = build_workload(tokenizer, load_texts(Path(args.prompts_file)), args)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 lora_request=loras[:2])  # warm-up
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, sp, lora_request=loras)
    wall = time.perf_counter() - start
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise RuntimeError(f"{cfg['name']}: {len(errors)} requests failed, first: {errors[0]}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttfts = [o.metrics.ttft_s * 1000.0 for o in outs if o.metrics.ttft_s is not None]
    return {"name": cfg["name"], "output_tok_s": n_out / wall, "ttft_p50_ms": statistics.median(ttfts),
            "wall_s": wall, "num_output_tokens": n_out, **{k: v for k, v in cfg.items() if k != "name"}}


def goal_ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The speed goal's ratios from the rows present: ``bgmv_n4_r8 / base`` (goal >= 0.75) and
    ``bgmv_n16_r8 / loop_n16_r8`` (goal >= 2)."""
    out = {}
    if "bgmv_n4_r8" in rows and "base" in rows:
        out["bgmv_n4_r8_vs_base"] = rows["bgmv_n4_r8"]["output_tok_s"] / rows["base"]["output_tok_s"]
    if "bgmv_n16_r8" in rows and "loop_n16_r8" in rows:
        out["bgmv_n16_r8_vs_loop"] = rows["bgmv_n16_r8"]["output_tok_s"] / rows["loop_n16_r8"]["output_tok_s"]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (the module docstring); list flags are comma lists."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_workload_args(p)
    p.set_defaults(num_prompts=64, input_len=128, output_len=128)
    p.add_argument("--backends", default="bgmv,sgmv,loop")
    p.add_argument("--num-adapters", default="1,4,16,64")
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--targets", default=ALL_TARGETS, help="comma list of the modules every adapter adapts")
    p.add_argument("--affinity-adapters", type=int, default=64)
    p.add_argument("--affinity-slots", type=int, default=8)
    p.add_argument("--affinity-rank", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="only the speed goal's rows")
    p.add_argument("--only", default=None, help="comma list of configuration names to run")
    p.add_argument("--adapter-dir", default=None, help="where adapters are saved (default: a temporary folder)")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a configuration's JSON: run it, print RESULT
    args = p.parse_args(argv)
    args.backends, args.targets = args.backends.split(","), args.targets.split(",")
    args.num_adapters = [int(n) for n in args.num_adapters.split(",")]
    args.ranks = [int(r) for r in args.ranks.split(",")]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every configuration in a child process, print the table and the goal ratios, write ``--json-out``."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    if args.one:
        print("RESULT " + json.dumps(run_one(args, json.loads(args.one))), flush=True)
        return {}
    from experiments.common import bench_dtype

    args.dtype = bench_dtype(args.model, args.dtype)
    info = machine_info()
    print(f"{info['isa']}, {info['num_cpus']} cores; {args.model} {args.dtype}, "
          f"{args.num_prompts} x {args.input_len} -> {args.output_len}", flush=True)
    cfgs = configurations(args)
    if args.only:
        cfgs = [c for c in cfgs if c["name"] in args.only.split(",")]
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        adapter_dir = args.adapter_dir or tmp
        for cfg in cfgs:
            cmd = [sys.executable, "-m", "experiments.offline.bench_lora", *argv, "--dtype", args.dtype,
                   "--adapter-dir", adapter_dir, "--one", json.dumps(cfg)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
            if proc.returncode != 0:
                raise RuntimeError(f"{cfg['name']} failed:\n{proc.stderr[-3000:]}")
            rows[cfg["name"]] = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
            row = rows[cfg["name"]]
            if "base" in rows:
                row["vs_base"] = row["output_tok_s"] / rows["base"]["output_tok_s"]
            print(f"{cfg['name']:<28} {row['output_tok_s']:9.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:9.1f} ms  "
                  f"x{row.get('vs_base', float('nan')):.2f} of base", flush=True)
    ratios = goal_ratios(rows)
    print(markdown_table(["configuration", "output tok/s", "TTFT p50 ms", "x base"],
                         [[n, f"{r['output_tok_s']:.1f}", f"{r['ttft_p50_ms']:.1f}",
                           f"{r.get('vs_base', float('nan')):.2f}"] for n, r in rows.items()]))
    for name, value in ratios.items():
        print(f"{name}: {value:.2f} (goal: {'>= 0.75' if 'base' in name else '>= 2'})")
    result = {"args": {k: v for k, v in vars(args).items() if k != "one"}, "machine": info, "code": code_state(),
              "rows": list(rows.values()), "goal_ratios": ratios}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
