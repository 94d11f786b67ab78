"""Pipeline parallelism on CPU: one rank vs PP=2 vs TP=2 (and TP=2 x PP=2), all ``executor=mp``.

Per system and batch size (``--batches``): output tok/s of a whole greedy ``generate`` (``ignore_eos``,
``--output-len`` tokens, ``--prompt-len``-token random prompts), the mean engine step, ms, and the bubble
fraction: per rank, the share of the ``generate``'s wall time it was not computing (waiting for the ring, for the
previous stage's hidden states or for the next stage to take its own: ``ModelRunner.execute_s`` minus
``pp_wait_s``), averaged over the ranks. ``pp2`` runs ``pipeline_parallel_size`` batches in flight (the engine's
batch queue, ``max_num_seqs`` per batch: half of ``--batches`` each); ``pp2_sync`` is the same engine with its queue
cut to one batch, so its stages run one after the other: the bubble without overlap. The issue's goal at batch 64:
PP=2's bubble under 15 % and its throughput at least 0.9x TP=2's on the same two cores. Each system checks that its
tokens equal the first system's (greedy, float32).

Example (the measured pass, quiet machine; ``smollm2`` needs its package)::

    .venv/bin/python -m experiments.offline.bench_pipeline --model smollm2 --json-out pipeline.json
    .venv/bin/python -m experiments.offline.bench_pipeline --batches 64 --systems tp2 pp2 pp2_sync
    .venv/bin/python -m experiments.offline.bench_pipeline --batches 4 --output-len 4   # smoke, stories260K
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from experiments.common import REPO_ROOT, write_json

#: system -> (tensor_parallel_size, pipeline_parallel_size, batches in flight: None = the executor's)
SYSTEMS = {"pp1": (1, 1, None), "pp2": (1, 2, None), "pp2_sync": (1, 2, 1), "tp2": (2, 1, None),
           "tp2_pp2": (2, 2, None), "tp2_pp2_sync": (2, 2, 1)}


def stage_times(worker: Any) -> tuple[float, float]:
    """``(execute_s, pp_wait_s)`` of a rank's model runner so far (run in the rank by ``collective_rpc``)."""
    return worker.runner.execute_s, worker.runner.pp_wait_s


def bubble_fraction(before: list[tuple[float, float]], after: list[tuple[float, float]], wall_s: float) -> float:
    """Mean over ranks of the share of ``wall_s`` a rank did not compute (``stage_times`` before and after)."""
    idle = [1.0 - ((e1 - e0) - (w1 - w0)) / wall_s for (e0, w0), (e1, w1) in zip(before, after)]
    return sum(idle) / len(idle)


def run_system(name: str, model: str, batches: list[int], prompt_len: int, output_len: int) -> dict[str, Any]:
    """One engine of ``SYSTEMS[name]``; per batch size its tokens, output tok/s, mean step (ms), bubble fraction
    and the most batches that were in flight at once."""
    from framework import LLM

    tp, pp, in_flight = SYSTEMS[name]
    rows = {}
    for batch in batches:  # an engine per batch size: max_num_seqs splits the batch over the stages
        llm = LLM(model=model, executor="mp", tensor_parallel_size=tp, pipeline_parallel_size=pp, dtype="float32",
                  attention="torch", compile="false", max_model_len=prompt_len + output_len + 8,
                  max_num_seqs=max(1, -(-batch // (in_flight or pp))))
        try:
            if in_flight is not None:
                llm.engine.batches.max_batches = in_flight  # the same engine, its stages one after the other
            rows[batch] = _measure(llm, batch, prompt_len, output_len)
        finally:
            llm.engine.shutdown()
    return rows


def _measure(llm: Any, batch: int, prompt_len: int, output_len: int) -> dict[str, Any]:
    """One greedy ``generate`` of ``batch`` random prompts on ``llm``: tokens, tok/s, step ms, bubble, peak in flight."""
    from framework import SamplingParams

    executor = llm.engine.executor
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    steps_before = llm.engine.metrics.summary().get("num_steps", 0)
    times_before = executor.collective_rpc(stage_times)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    times_after = executor.collective_rpc(stage_times)
    steps = llm.engine.metrics.summary().get("num_steps", 0) - steps_before
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "output_tok_s": batch * output_len / elapsed,
            "mean_step_ms": 1e3 * elapsed / max(steps, 1),
            "bubble_fraction": bubble_fraction(times_before, times_after, elapsed),
            "peak_batches_in_flight": llm.engine.batches.peak_in_flight}


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
            print(f"{name:12s} batch {batch:3d}: {row['output_tok_s']:8.1f} output tok/s, "
                  f"{row['mean_step_ms']:7.2f} ms/step, bubble {100 * row['bubble_fraction']:5.1f} %, "
                  f"{row['peak_batches_in_flight']} in flight, tokens equal: {row['tokens_equal_first_system']}")
        report["systems"][name] = rows
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
