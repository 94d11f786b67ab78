"""Pipeline parallelism on CPU: one rank vs PP=2 vs TP=2 (and TP=2 x PP=2), all ``executor=mp``.

Per system and batch size (``--batches``): output tok/s of a whole greedy ``generate`` (``ignore_eos``,
``--output-len`` tokens, ``--prompt-len``-token random prompts) and the mean engine step, ms. With one
batch in flight the stages run one after the other, so PP=2 is expected to be slower than one rank on
the same cores (the hand-off and the idle stage are its cost); this measures that cost, and is the
baseline the batch queue (micro-batches in flight) must beat. Each system checks that its tokens equal
the first system's (greedy, float32).

Example (the measured pass, quiet machine; ``smollm2`` needs its package)::

    .venv/bin/python -m experiments.offline.bench_pipeline --model smollm2 --json-out pipeline.json
    .venv/bin/python -m experiments.offline.bench_pipeline --batches 1 --output-len 4   # smoke, stories260K
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from experiments.common import REPO_ROOT

#: system -> (tensor_parallel_size, pipeline_parallel_size)
SYSTEMS = {"pp1": (1, 1), "pp2": (1, 2), "tp2": (2, 1), "tp2_pp2": (2, 2)}


def run_system(name: str, model: str, batches: list[int], prompt_len: int, output_len: int) -> dict[str, Any]:
    """One engine of ``SYSTEMS[name]``; per batch size its tokens, output tok/s and mean step (ms)."""
    from framework import LLM, SamplingParams

    tp, pp = SYSTEMS[name]
    llm = LLM(model=model, executor="mp", tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32",
              attention="torch", compile="false", max_model_len=prompt_len + output_len + 8)
    try:
        vocab = llm.get_tokenizer().vocab_size
        rows = {}
        for batch in batches:
            rng = random.Random(batch)
            prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}
                       for _ in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            steps_before = llm.engine.metrics.summary().get("num_steps", 0)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t0
            steps = llm.engine.metrics.summary().get("num_steps", 0) - steps_before
            rows[batch] = {"tokens": [o.outputs[0].token_ids for o in outs],
                           "output_tok_s": batch * output_len / elapsed,
                           "mean_step_ms": 1e3 * elapsed / max(steps, 1)}
        return rows
    finally:
        llm.engine.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every chosen system; prints one line per (system, batch) and returns (and writes) the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO_ROOT / "models" / "stories260K"))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"model": args.model, "systems": {}}
    reference = None
    for name in args.systems:
        rows = run_system(name, args.model, args.batches, args.prompt_len, args.output_len)
        for batch, row in rows.items():
            tokens = row.pop("tokens")
            if reference is None or batch not in reference:
                reference = {**(reference or {}), batch: tokens}
            row["tokens_equal_first_system"] = tokens == reference[batch]
            print(f"{name:8s} batch {batch:3d}: {row['output_tok_s']:8.1f} output tok/s, "
                  f"{row['mean_step_ms']:7.2f} ms/step, tokens equal: {row['tokens_equal_first_system']}")
        report["systems"][name] = rows
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
