"""Paired batch-1 rounds in one engine, for A/B experiments of one engine feature (``bench_lm_head.py``,
``bench_layer_stack.py``): the same request generated once per mode in every round, the order
alternating by round, so the machine's drift over minutes falls on both modes alike."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_request_args(p: argparse.ArgumentParser, rounds: int) -> None:
    """The request and output options every paired script takes (``--model`` ... ``--json-out``)."""
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", help="auto: the dtype servelab's dtype=auto picks on this CPU (float32 for bf16 on AVX2 only)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--json-out", default=None)


def paired_rounds(llm: Any, modes: tuple[str, str], set_mode: Callable[[str], None],
                  args: argparse.Namespace) -> dict[str, Any]:
    """``args.rounds`` rounds of one batch-1 request per mode (after one warm generate in ``modes[0]``).

    Each generate: ``args.prompt_len`` prompt token ids, ``args.output_len`` output tokens, greedy,
    ``ignore_eos``, the prefix cache reset first (the prompt is prefilled every time).

    Args:
        llm: a built ``framework.LLM``.
        modes: the two modes' names; ratios are ``modes[1] / modes[0]``.
        set_mode: switches the engine to a mode before its generate.

    Returns:
        ``{"cpu", "rounds": [{"round", "mode", "ms_per_token", "forward_ms"}...], "summary"}``:
        ms/token is wall seconds / output tokens (prefill included), forward_ms the median
        ``ModelRunnerOutput.forward_s`` of the generate's steps after its first; ``summary[key]`` per
        mode the median and ``paired_<modes[1]>_over_<modes[0]>`` each round's ratio; ``same_tokens``.
    """
    from framework import SamplingParams
    from framework.platform import cpu_isa
    from framework.worker import model_runner

    prompt = [{"prompt_token_ids": [(17 * i) % 1000 + 100 for i in range(args.prompt_len)]}]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    forward_s: list[float] = []
    tokens: dict[str, list[int]] = {}
    execute = model_runner.ModelRunner.execute_scheduled

    def timed(runner: Any, so: Any) -> Any:
        out = execute(runner, so)
        forward_s.append(out.forward_s)
        return out

    def one(mode: str) -> dict[str, Any]:
        set_mode(mode)
        llm.engine.scheduler.kv.reset_prefix_cache()
        forward_s.clear()
        t0 = time.perf_counter()
        out = llm.generate(prompt, params)[0].outputs[0]
        seconds = time.perf_counter() - t0
        tokens.setdefault(mode, list(out.token_ids))
        return {"mode": mode, "ms_per_token": 1000 * seconds / len(out.token_ids),
                "forward_ms": 1000 * statistics.median(forward_s[1:] or forward_s)}

    model_runner.ModelRunner.execute_scheduled = timed
    try:
        one(modes[0])  # warm: the first generate pays one-off costs
        rounds = [{"round": r, **one(mode)} for r in range(args.rounds) for mode in (modes if r % 2 == 0 else modes[::-1])]
    finally:
        model_runner.ModelRunner.execute_scheduled = execute
    summary: dict[str, Any] = {}
    for key in ("ms_per_token", "forward_ms"):
        by = {m: [x[key] for x in rounds if x["mode"] == m] for m in modes}
        summary[key] = {m: statistics.median(v) for m, v in by.items()}
        summary[key][f"paired_{modes[1]}_over_{modes[0]}"] = [b / a for a, b in zip(by[modes[0]], by[modes[1]], strict=True)]
    summary["same_tokens"] = tokens[modes[0]] == tokens[modes[1]]
    return {"cpu": cpu_isa().summary(), "rounds": rounds, "summary": summary}


def report(result: dict[str, Any], args: argparse.Namespace, modes: tuple[str, str]) -> None:
    """Print the medians and paired ratios; write ``args.json_out`` when given."""
    s = result["summary"]
    print(f"cpu: {result['cpu']}; model {args.model} {args.dtype}, prompt {args.prompt_len}, {args.output_len} tokens")
    ratio = f"paired_{modes[1]}_over_{modes[0]}"
    for key in ("ms_per_token", "forward_ms"):
        print(f"{key:<13} {modes[0]} {s[key][modes[0]]:.2f}  {modes[1]} {s[key][modes[1]]:.2f}  "
              f"{modes[1]}/{modes[0]} by round: {' '.join(f'{x:.3f}' for x in s[key][ratio])}")
    print(f"same tokens: {s['same_tokens']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
