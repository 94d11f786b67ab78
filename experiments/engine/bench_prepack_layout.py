"""oneDNN's packed-weight layout by row hint: one decoder layer's GEMMs at each row count, per dtype.

``torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)`` lays a weight out for a row count, and
``framework/model_executor/prepack.py`` picks that hint per dtype (``LAYER_BATCH_HINT``). This measures the choice:
for each ``--dtypes`` and ``--rows`` value, the GEMMs of one decoder layer of ``--model`` (its config's
shapes: fused q/k/v, o, gate, up, down, as a compiled many-token step runs them) with the weights packed
for each ``--hints`` value, in ``--rounds`` rounds alternating the hints' order, so the machine's drift
falls on every hint alike. Random weights and activations (the timing does not depend on values).

Reported per (dtype, rows): the median ms of one layer's GEMMs per hint and each hint's ratio to the
first (> 1: slower than the first hint).

Example (2-core CPU, SmolLM2-135M; the sixth session's numbers are in docs/results.md)::

    .venv/bin/python -m experiments.engine.bench_prepack_layout --model smollm2 --json-out docs/results/cpu_speed/prepack_layout.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch


def layer_shapes(model: str) -> dict[str, tuple[int, int]]:
    """``{name: (in_features, out_features)}`` of one decoder layer's GEMMs, from the model's config
    (``model_loader.load_model_config``, whose errors it raises)."""
    from framework.model_executor.model_loader import load_model_config

    cfg = load_model_config(model).get_text_config()
    hidden, inter, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return {"qkv": (hidden, (heads + 2 * kv) * head_dim), "o": (heads * head_dim, hidden),
            "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (dtype, rows) cell (see the module docstring).

    Returns:
        ``{"cpu", "args", "shapes", "hints", "cells": [{"dtype", "rows", "ms": {hint: median},
        "ratio_to_first": {hint: x}}], "skipped": {dtype: why}}`` (``cpu``: model name and ISA flags; a dtype
        oneDNN cannot pack on this CPU is skipped).
    """
    from framework.model_executor.prepack import onednn_has_kernels
    from framework.platform import cpu_isa

    torch.manual_seed(0)
    shapes = layer_shapes(args.model)
    hints = [int(h) for h in args.hints.split(",")]
    cells, skipped = [], {}
    isa = cpu_isa()
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        if not onednn_has_kernels(dtype):  # e.g. bf16 on an AVX2-only CPU: oneDNN refuses to pack it
            skipped[dtype_name] = f"oneDNN has no {dtype_name} path on {isa.summary()}"
            continue
        weights = {n: torch.randn(out_f, in_f).to(dtype) for n, (in_f, out_f) in shapes.items()}
        packed = {h: {n: torch.ops.mkldnn._reorder_linear_weight(w, h) for n, w in weights.items()} for h in hints}
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {n: torch.randn(rows, in_f).to(dtype) for n, (in_f, _) in shapes.items()}
            times: dict[int, list[float]] = {h: [] for h in hints}
            for r in range(args.rounds):
                for h in (hints if r % 2 == 0 else hints[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(args.inner):
                        for n in shapes:
                            torch.ops.mkldnn._linear_pointwise(xs[n], packed[h][n], None, "none", [], "")
                    times[h].append(1000 * (time.perf_counter() - t0) / args.inner)
            ms = {h: statistics.median(v) for h, v in times.items()}
            cells.append({"dtype": dtype_name, "rows": rows, "ms": ms,
                          "ratio_to_first": {h: ms[h] / ms[hints[0]] for h in hints}})
    return {"cpu": isa.summary(), "args": vars(args), "shapes": shapes, "hints": hints, "cells": cells,
            "skipped": skipped}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run, print the table, write ``--json-out``; returns the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="servelab model alias or folder (its config's shapes)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rows", default="1,4,16,64", help="comma list of GEMM row counts (tokens in a step)")
    p.add_argument("--hints", default="1,64", help="comma list of layout row hints; ratios are to the first")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--inner", type=int, default=5, help="layer passes per timed round")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    hints = result["hints"]
    print(f"cpu: {result['cpu']}; {args.model} layer GEMMs {result['shapes']}; {torch.get_num_threads()} threads")
    print(f"{'dtype':<10}{'rows':>6}" + "".join(f"{f'hint {h} ms':>13}{'ratio':>7}" for h in hints))
    for c in result["cells"]:
        print(f"{c['dtype']:<10}{c['rows']:>6}"
              + "".join(f"{c['ms'][h]:>13.3f}{c['ratio_to_first'][h]:>7.2f}" for h in hints))
    for dtype_name, why in result["skipped"].items():
        print(f"{dtype_name}: skipped ({why})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
