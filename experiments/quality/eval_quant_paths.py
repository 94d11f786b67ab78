"""lm-eval scores of a pre-quantized checkpoint's fast paths against its reference path (issue 61: "the fast paths:
greedy agreement and lm-eval scores within a stated tolerance of the reference path").

The checkpoint is written once into ``--out`` by ``scripts/quantize_checkpoint.py`` (round-to-nearest in the
format's packing). Each ``--kernels`` entry is one ``servelab eval`` run (``quant.params.kernel=<kernel>``:
``reference`` dequantizes every layer to ``--dtype`` at load, the oracle; ``auto`` the fast path, servelab's fused
int4 GEMM for bf16 on AVX512-BF16; ``aten`` torch's int4 kernel) over ``eval_parity``'s local tasks (arithmetic
multiple choice, rolling loglikelihood of the repository's docs, greedy generations). Printed per fast path against
the reference: score differences, the largest per-document loglikelihood difference, generated strings that
differ, and the verdict against the stated tolerances (``--acc-tol`` absolute on multiple-choice accuracy,
``--bpb-rel-tol`` relative on bits per byte).

    .venv/bin/python -m experiments.quality.eval_quant_paths --model smollm2 --dtype bfloat16 \\
        --out outputs/eval_quant_paths
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT, machine_info
from experiments.quality.eval_parity import TASKS, compare, run_servelab, write_tasks


def write_checkpoint(args: argparse.Namespace, folder: Path) -> None:
    """``args.model`` in ``args.format`` at ``folder`` (kept when already written)."""
    if (folder / "config.json").is_file():
        return
    spec = importlib.util.spec_from_file_location("quantize_checkpoint", REPO_ROOT / "scripts" / "quantize_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.quantize_checkpoint(args.model, folder, args.format, bits=args.bits, group_size=args.group_size,
                               desc_act=args.desc_act, sym=not args.no_sym)


def against_reference(scores: dict[str, dict[str, float]], ref: dict[str, dict[str, float]],
                      samples: dict, ref_samples: dict, acc_tol: float, bpb_rel_tol: float) -> dict[str, Any]:
    """One fast path's scores against the reference's: differences, per-document ones (``eval_parity.compare``)
    and ``within_tolerance`` (multiple-choice ``acc``/``acc_norm`` within ``acc_tol`` absolute, ``bits_per_byte``
    within ``bpb_rel_tol`` relative)."""
    mc, ppl = "servelab_mc_large", "servelab_ppl_large"
    diffs = {f"{mc}_{m}_diff": scores[mc][m] - ref[mc][m] for m in ("acc", "acc_norm")}
    diffs[f"{ppl}_bits_per_byte_rel_diff"] = scores[ppl]["bits_per_byte"] / ref[ppl]["bits_per_byte"] - 1
    ok = (all(abs(diffs[f"{mc}_{m}_diff"]) <= acc_tol for m in ("acc", "acc_norm"))
          and abs(diffs[f"{ppl}_bits_per_byte_rel_diff"]) <= bpb_rel_tol)
    return {**diffs, **compare(samples, ref_samples), "within_tolerance": ok}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--format", default="gptq", choices=("gptq", "awq", "compressed-tensors"))
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--desc-act", action="store_true")
    parser.add_argument("--no-sym", action="store_true", help="asymmetric (zero points)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", default="false")
    parser.add_argument("--kernels", default="reference,auto,aten", help="first: the reference the others are held to")
    parser.add_argument("--num-mc", type=int, default=200)
    parser.add_argument("--num-ppl", type=int, default=60)
    parser.add_argument("--num-gen", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-concurrent", type=int, default=1)
    parser.add_argument("--acc-tol", type=float, default=0.02, help="absolute, multiple-choice acc and acc_norm")
    parser.add_argument("--bpb-rel-tol", type=float, default=0.01, help="relative, rolling bits per byte")
    parser.add_argument("--out", default="outputs/eval_quant_paths")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1:]  # Hydra overrides for every `servelab eval` run
    out = Path(args.out).resolve()
    folder = out / f"{Path(args.model).name}-{args.format}-w{args.bits}-g{args.group_size}"
    write_checkpoint(args, folder)
    write_tasks(out / "tasks", args.num_mc, args.num_ppl, args.num_gen)
    method = args.format.replace("-", "_")
    runs: dict[str, dict[str, Any]] = {}
    kernels = [k for k in args.kernels.split(",") if k]
    for kernel in kernels:
        run_args = argparse.Namespace(**{**vars(args), "model": str(folder),
                                         "overrides": [f"quant={method}", f"quant.params.kernel={kernel}", *extra]})
        metrics, samples, wall = run_servelab(run_args, out / "tasks", out / f"run_{kernel}")
        runs[kernel] = {"scores": metrics["eval"], "samples": samples, "wall_s": wall}
        print(f"{kernel}: {json.dumps(metrics['eval'])}", flush=True)
    ref = kernels[0]
    record = {"machine": machine_info(), "args": vars(args), "checkpoint": str(folder), "tasks": list(TASKS),
              "reference": ref, "scores": {k: r["scores"] for k, r in runs.items()},
              "wall_s": {k: r["wall_s"] for k, r in runs.items()},
              "against_reference": {k: against_reference(runs[k]["scores"], runs[ref]["scores"], runs[k]["samples"],
                                                         runs[ref]["samples"], args.acc_tol, args.bpb_rel_tol)
                                    for k in kernels[1:]}}
    (out / "eval_quant_paths.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("scores", "against_reference")}, indent=2))
    return record


if __name__ == "__main__":
    main()
