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

    .venv/bin/python experiments/bench_lm_head.py --model smollm2 --rounds 6 --json-out docs/results/issue43/lm_head.json
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The paired rounds (see the module docstring).

    Returns:
        ``{"cpu", "args", "rounds": [{"mode", "ms_per_token", "forward_ms"}...], "summary"}``.

    Raises:
        RuntimeError: the engine has no compiled one-row head (a head below the threshold, tensor
            parallelism, or compilation fell back).
    """
    from framework import LLM
    from framework.worker import compile as compile_module
    from framework.worker import model_runner

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
    forward_s: list[float] = []
    execute = model_runner.ModelRunner.execute_scheduled

    def timed(runner: Any, so: Any) -> Any:
        out = execute(runner, so)
        forward_s.append(out.forward_s)
        return out

    model_runner.ModelRunner.execute_scheduled = timed
    try:
        return _rounds(args, llm, compiled, head, forward_s)
    finally:
        compiled._head = head
        model_runner.ModelRunner.execute_scheduled = execute


def _rounds(args: argparse.Namespace, llm: Any, compiled: Any, head: Any, forward_s: list[float]) -> dict[str, Any]:
    """:func:`run`'s rounds on the built engine (``forward_s`` fills with each step's forward seconds)."""
    from framework import SamplingParams
    from framework.sim.profile import cpu_name

    prompt = [{"prompt_token_ids": [(17 * i) % 1000 + 100 for i in range(args.prompt_len)]}]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tokens: dict[str, list[int]] = {}

    def one(mode: str) -> dict[str, Any]:
        compiled._head = head if mode == "compiled" else None
        llm.engine.scheduler.kv.reset_prefix_cache()  # the prompt is prefilled every time
        forward_s.clear()
        t0 = time.perf_counter()
        out = llm.generate(prompt, params)[0].outputs[0]
        seconds = time.perf_counter() - t0
        tokens.setdefault(mode, list(out.token_ids))
        return {"mode": mode, "ms_per_token": 1000 * seconds / len(out.token_ids),
                "forward_ms": 1000 * statistics.median(forward_s[1:] or forward_s)}

    one("compiled")  # warm: the first generate pays one-off costs
    rounds = []
    for r in range(args.rounds):
        for mode in (("compiled", "eager") if r % 2 == 0 else ("eager", "compiled")):
            rounds.append({"round": r, **one(mode)})
    summary: dict[str, Any] = {}
    for key in ("ms_per_token", "forward_ms"):
        by = {m: [x[key] for x in rounds if x["mode"] == m] for m in ("compiled", "eager")}
        summary[key] = {m: statistics.median(v) for m, v in by.items()}
        summary[key]["paired_eager_over_compiled"] = [e / c for c, e in zip(by["compiled"], by["eager"], strict=True)]
    summary["same_tokens"] = tokens["compiled"] == tokens["eager"]
    return {"cpu": cpu_name(), "args": vars(args), "rounds": rounds, "summary": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, run, print the table, write ``--json-out``; returns the result."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--min-head-bytes", type=int, default=None,
                   help="override COMPILED_HEAD_MIN_BYTES (0 compiles any head, e.g. a tiny model's)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    result = run(args)
    s = result["summary"]
    print(f"cpu: {result['cpu']}; model {args.model} {args.dtype}, prompt {args.prompt_len}, {args.output_len} tokens")
    for key in ("ms_per_token", "forward_ms"):
        paired = " ".join(f"{x:.3f}" for x in s[key]["paired_eager_over_compiled"])
        print(f"{key:<13} compiled head {s[key]['compiled']:.2f}  eager head {s[key]['eager']:.2f}  "
              f"paired eager/compiled: {paired}")
    print(f"same tokens: {s['same_tokens']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
