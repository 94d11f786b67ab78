"""Structured-output overhead per grammar engine: compile time (cold and cached), per-step mask time,
and end-to-end output tok/s constrained vs unconstrained on the same prompts.

Compile: each constraint compiled once cold (fresh plugin, empty cache) and once through the engine's
cache (``StructuredOutputManager``). Mask time: wall time of ``grammar_bitmask`` (fill every row's
bitmask on the driver; applying it to the logits is now part of the worker's sampling time) per
engine step, measured by wrapping it. End to end: the same
prompts with ``json`` schema constraints vs none, greedy, ``ignore_eos`` off.

Example (the real measurement, quiet machine):
    .venv/bin/python -m experiments.offline.bench_structured --model smollm2 --num-prompts 32 --max-tokens 128
Smoke:
    .venv/bin/python -m experiments.offline.bench_structured --model models/stories260K --num-prompts 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from experiments.common import bench_dtype
from framework import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"]}}, "required": ["name", "age", "tags", "address"]}
CONSTRAINTS = {"json": SCHEMA, "regex": r"[A-Z][a-z]{2,10}( [a-z]{2,10}){0,5}\.", "choice": ["yes", "no", "maybe"],
               "grammar": 'root ::= item ("," item)*\nitem ::= [a-z]+'}


def bench_compile(llm: LLM) -> dict[str, dict[str, float]]:
    """Per constraint kind, seconds: ``cold_s`` compiles with a fresh plugin instance (no engine or
    library cache); ``cached_s`` is a second request's path through the engine cache (lookup of the
    compiled grammar + a fresh matcher)."""
    manager, engine = llm.engine.structured_output, llm.engine
    out = {}
    for kind, spec in CONSTRAINTS.items():
        key = StructuredOutputsParams(**{kind: spec}).kind_and_spec()
        fresh = type(manager.grammar)(tokenizer=engine.tokenizer, vocab_size=manager.vocab_size,
                                      eos_token_ids=engine.eos_token_ids, **engine.config.plugin_params("grammar"))
        t0 = time.perf_counter()
        compiled = fresh.compile(*key)
        cold = time.perf_counter() - t0
        manager._cache.setdefault(key, manager._pool.submit(lambda c=compiled: c)).result()
        t0 = time.perf_counter()
        manager.grammar.matcher(manager._cache[key].result())
        out[kind] = {"cold_s": cold, "cached_s": time.perf_counter() - t0}
    return out


def bench_e2e(llm: LLM, prompts: list[str], max_tokens: int, constrained: bool) -> dict[str, float]:
    """Output tok/s over the whole batch, plus mean/p50 per-step mask time (ms) when constrained."""
    manager = llm.engine.structured_output
    mask_times: list[float] = []
    original = manager.grammar_bitmask

    def timed(scheduler_output):
        t0 = time.perf_counter()
        out = original(scheduler_output)
        mask_times.append(time.perf_counter() - t0)
        return out

    manager.grammar_bitmask = timed
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    finally:
        manager.grammar_bitmask = original
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"output_tokens": num_tokens, "elapsed_s": elapsed, "tok_per_s": num_tokens / elapsed,
              "num_errors": sum(o.error is not None for o in outs)}
    if constrained and mask_times:
        result["mask_ms_mean"] = 1e3 * statistics.fmean(mask_times)
        result["mask_ms_p50"] = 1e3 * statistics.median(mask_times)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="auto: the dtype servelab's dtype=auto picks on this CPU (float32 for bf16 on AVX2 only)")
    p.add_argument("--grammars", default="xgrammar,llguidance")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max positions")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    args.dtype = bench_dtype(args.model, args.dtype)
    base = ["Give a person record as JSON.", "Describe a city resident in JSON.", "Output a JSON profile."]
    prompts = [base[i % len(base)] + f" Person {i}." for i in range(args.num_prompts)]
    report = {"model": args.model, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "grammars": {}}
    for name in args.grammars.split(","):
        llm = LLM(model=args.model, dtype=args.dtype, grammar=name, max_model_len=args.max_model_len)
        bench_e2e(llm, prompts[:2], 8, constrained=True)  # warm-up (weights, kernels, compile)
        entry = {"compile": bench_compile(llm),
                 "unconstrained": bench_e2e(llm, prompts, args.max_tokens, constrained=False),
                 "constrained_json": bench_e2e(llm, prompts, args.max_tokens, constrained=True)}
        entry["slowdown"] = entry["unconstrained"]["tok_per_s"] / max(entry["constrained_json"]["tok_per_s"], 1e-9)
        report["grammars"][name] = entry
        print(json.dumps({name: entry}, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
