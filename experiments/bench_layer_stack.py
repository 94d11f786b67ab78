"""The layer stack (``framework/worker/layer_stack.py``) against per-layer calls, paired in one process.

One compiled engine (``engine.compile=true``) generates a batch-1 request (``--prompt-len`` prompt token
ids, ``--output-len`` output tokens, greedy, ``ignore_eos``) in ``--rounds`` rounds; each round runs it
once with its steps' layers stacked (run from layer 0's call as one loop of graph calls) and once
per layer (``LayerGraphs.stack_enabled`` off: transformers' loop calls each layer's graph through
dynamo's bytecode), the order alternating by round, so the machine's drift over minutes falls on both
alike. Reported per mode: ms/token of each generate (wall seconds / output tokens, prefill included)
and the median forward time of its steps after the first (``ModelRunnerOutput.forward_s``); then the
medians and the paired ratios per-layer / stacked (> 1: the stack is faster). Both modes must give the
same tokens (the same kernels run on the same inputs).

Example (2-core CPU, SmolLM2-135M bf16; the seventh session's numbers are in docs/results.md)::

    .venv/bin/python experiments/bench_layer_stack.py --model smollm2 --rounds 10 --json-out docs/results/issue43/layer_stack.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
MODES = ("stacked", "per_layer")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The paired rounds (see the module docstring).

    Returns:
        ``{"cpu", "args", "layer_stack", "rounds": [{"round", "mode", "ms_per_token", "forward_ms"}...],
        "summary"}``.

    Raises:
        RuntimeError: the engine's compilation fell back to eager, or no step key was stacked (the
            model's loop does more than chain its layers: ``layer_stack`` says why).
    """
    from framework import LLM, SamplingParams
    from framework.sim.profile import cpu_name
    from framework.worker import model_runner

    llm = LLM(model=args.model, dtype=args.dtype, compile=True)
    compiled = llm.engine.runner.compiled
    if compiled is None or compiled.graphs is None:
        raise RuntimeError("the engine is not compiled (compilation fell back to eager: see its log)")
    graphs = compiled.graphs
    prompt = [{"prompt_token_ids": [(17 * i) % 1000 + 100 for i in range(args.prompt_len)]}]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    forward_s: list[float] = []
    execute = model_runner.ModelRunner.execute_scheduled

    def timed(runner: Any, so: Any) -> Any:
        out = execute(runner, so)
        forward_s.append(out.forward_s)
        return out

    tokens: dict[str, list[int]] = {}

    def one(mode: str) -> dict[str, Any]:
        graphs.stack_enabled = mode == "stacked"
        llm.engine.scheduler.kv.reset_prefix_cache()  # the prompt is prefilled every time
        forward_s.clear()
        t0 = time.perf_counter()
        out = llm.generate(prompt, params)[0].outputs[0]
        seconds = time.perf_counter() - t0
        tokens.setdefault(mode, list(out.token_ids))
        return {"mode": mode, "ms_per_token": 1000 * seconds / len(out.token_ids),
                "forward_ms": 1000 * statistics.median(forward_s[1:] or forward_s)}

    model_runner.ModelRunner.execute_scheduled = timed
    try:
        one("stacked")  # warm: the first generate compiles nothing more but watches each step key once
        if not any(v == "stacked" for v in graphs.layer_stack.values()):
            raise RuntimeError(f"no step key runs stacked: {graphs.layer_stack}")
        rounds = []
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                rounds.append({"round": r, **one(mode)})
    finally:
        model_runner.ModelRunner.execute_scheduled = execute
        graphs.stack_enabled = True
    summary: dict[str, Any] = {}
    for key in ("ms_per_token", "forward_ms"):
        by = {m: [x[key] for x in rounds if x["mode"] == m] for m in MODES}
        summary[key] = {m: statistics.median(v) for m, v in by.items()}
        summary[key]["paired_per_layer_over_stacked"] = [p / s for s, p in zip(by["stacked"], by["per_layer"],
                                                                                 strict=True)]
    summary["same_tokens"] = tokens["stacked"] == tokens["per_layer"]
    return {"cpu": cpu_name(), "args": vars(args), "layer_stack": dict(graphs.layer_stack), "rounds": rounds,
            "summary": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run, print the table, write ``--json-out``; returns the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    s = result["summary"]
    print(f"cpu: {result['cpu']}; model {args.model} {args.dtype}, prompt {args.prompt_len}, {args.output_len} tokens")
    print(f"layer stack: {result['layer_stack']}")
    for key in ("ms_per_token", "forward_ms"):
        paired = " ".join(f"{x:.3f}" for x in s[key]["paired_per_layer_over_stacked"])
        print(f"{key:<13} stacked {s[key]['stacked']:.2f}  per layer {s[key]['per_layer']:.2f}  "
              f"paired per-layer/stacked: {paired}")
    print(f"same tokens: {s['same_tokens']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
