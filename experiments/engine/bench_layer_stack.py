"""The layer stack (``framework/compilation/layer_stack.py``) against per-layer calls, paired in one process.

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

    .venv/bin/python -m experiments.engine.bench_layer_stack --model smollm2 --rounds 10 --json-out docs/results/batch1/layer_stack.json
"""

from __future__ import annotations

import argparse
from typing import Any

from experiments.engine._paired_batch1 import add_request_args, paired_rounds, report

MODES = ("stacked", "per_layer")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The paired rounds (see the module docstring; ``experiments/engine/_paired_batch1.py``).

    Returns:
        ``{"cpu", "args", "layer_stack", "rounds": [{"round", "mode", "ms_per_token", "forward_ms"}...],
        "summary"}``.

    Raises:
        RuntimeError: the engine's compilation fell back to eager, or no step key was stacked (the
            model's loop does more than chain its layers: ``layer_stack`` says why).
    """
    from framework import LLM

    llm = LLM(model=args.model, dtype=args.dtype, compile=True)
    compiled = llm.engine.runner.compiled
    if compiled is None or compiled.graphs is None:
        raise RuntimeError("the engine is not compiled (compilation fell back to eager: see its log)")
    graphs = compiled.graphs

    def set_mode(mode: str) -> None:
        graphs.stack_enabled = mode == "stacked"

    try:
        result = paired_rounds(llm, MODES, set_mode, args)
    finally:
        graphs.stack_enabled = True
    if not any(v == "stacked" for v in graphs.layer_stack.values()):
        raise RuntimeError(f"no step key runs stacked: {graphs.layer_stack}")
    return {"cpu": result["cpu"], "args": vars(args), "layer_stack": dict(graphs.layer_stack),
            "rounds": result["rounds"], "summary": result["summary"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run, print the table, write ``--json-out``; returns the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_args(p, rounds=10)
    args = p.parse_args(argv)
    result = run(args)
    print(f"layer stack: {result['layer_stack']}")
    report(result, args, MODES)
    return result


if __name__ == "__main__":
    main()
