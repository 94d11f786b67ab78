"""The one-row LM head graph (``CompiledDecoder.logits``) against the eager head, paired in one process.

One compiled engine (``engine.compile=true``) generates a batch-1 request (``--prompt-len`` prompt token
ids, ``--output-len`` output tokens, greedy, ``ignore_eos``) in ``--rounds`` rounds; each round runs it
once with the compiled one-row head and once with the head eager (the engine's ``_head`` set aside),
the order alternating by round, so the machine's drift over minutes falls on both alike. Reported per
mode: ms/token of each generate (wall seconds / output tokens, prefill included) and the median
forward time of its decode steps (``ModelRunnerOutput.forward_s``); then the medians and the paired
ratios eager / compiled (> 1: the compiled head is faster). Both modes must give the same tokens (the
script says when they do not: the heads round differently in their last bits).

``--min-head-bytes`` overrides ``COMPILED_HEAD_MIN_BYTES`` for the run (a tiny model's head is below it).

Example (2-core CPU, SmolLM2-135M bf16; the fifth session's numbers are in docs/results.md)::

    .venv/bin/python -m experiments.engine.bench_lm_head --model smollm2 --rounds 6 --json-out docs/results/batch1/lm_head.json
"""

from __future__ import annotations

import argparse
from typing import Any

from experiments.engine._paired_batch1 import add_request_args, paired_rounds, report

MODES = ("compiled", "eager")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The paired rounds (see the module docstring; ``experiments/engine/_paired_batch1.py``).

    Returns:
        ``{"cpu", "args", "rounds": [{"round", "mode", "ms_per_token", "forward_ms"}...], "summary"}``.

    Raises:
        RuntimeError: the engine has no compiled one-row head (a head below the threshold, tensor
            parallelism, or compilation fell back).
    """
    from framework import LLM
    from framework.compilation import decoder as compile_module

    threshold = compile_module.COMPILED_HEAD_MIN_BYTES
    if args.min_head_bytes is not None:
        compile_module.COMPILED_HEAD_MIN_BYTES = args.min_head_bytes
    try:
        llm = LLM(model=args.model, dtype=args.dtype, compile=True)
    finally:  # only this engine: later ones in the process (the suite's) keep the engine's rule
        compile_module.COMPILED_HEAD_MIN_BYTES = threshold
    compiled = llm.engine.runner.compiled
    if compiled is None or compiled._head is None:
        raise RuntimeError("no compiled one-row LM head here (head under COMPILED_HEAD_MIN_BYTES, tensor "
                           "parallelism, or compilation fell back): pass --min-head-bytes 0 for a tiny model")
    head = compiled._head

    def set_mode(mode: str) -> None:
        compiled._head = head if mode == "compiled" else None

    try:
        result = paired_rounds(llm, MODES, set_mode, args)
    finally:
        compiled._head = head
    return {"cpu": result["cpu"], "args": vars(args), "rounds": result["rounds"], "summary": result["summary"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run, print the table, write ``--json-out``; returns the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_request_args(p, rounds=6)
    p.add_argument("--min-head-bytes", type=int, default=None,
                   help="override COMPILED_HEAD_MIN_BYTES (0 compiles any head, e.g. a tiny model's)")
    args = p.parse_args(argv)
    result = run(args)
    report(result, args, MODES)
    return result


if __name__ == "__main__":
    main()
