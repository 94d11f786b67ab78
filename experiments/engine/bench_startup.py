"""Seconds to start an ``executor=mp`` engine, the first and the following ones in one process, per way of starting
child processes (``SERVELAB_WORKER_MULTIPROC_METHOD``: ``spawn`` starts a fresh interpreter per rank that imports
torch, transformers and servelab; ``forkserver``, the Linux default, forks each rank from a server that imported
them once per launching process).

Each method runs in its own fresh Python process (the fork server lives as long as its launcher): it builds
``--engines`` engines one after the other (``tensor_parallel_size``, stories260K, float32), each timed from
``LLM(...)`` to ready, then one greedy request, then shut down; the methods alternate over ``--rounds``. Reported:
the median first-engine and later-engine start-up per method and their ratios (spawn over forkserver), the tokens
equal across methods, the CPU and its ISA flags. Nothing else may run on the machine meanwhile.

Usage: ``python -m experiments.engine.bench_startup [--tp 2] [--engines 3] [--rounds 2] [--json-out F]``
(``--engines 2 --rounds 1`` is a minute-long smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from experiments.common import REPO_ROOT, code_state, machine_info, markdown_table, write_json

METHODS = ("spawn", "forkserver")


def _child(tp: int, engines: int) -> dict[str, Any]:
    """In the measuring process: build ``engines`` engines in turn; their start-up seconds and greedy tokens."""
    from framework import LLM, SamplingParams

    starts, tokens = [], []
    for _ in range(engines):
        begin = time.perf_counter()
        llm = LLM(model=str(REPO_ROOT / "models" / "stories260K"), dtype="float32", executor="mp",
                  tensor_parallel_size=tp)
        starts.append(time.perf_counter() - begin)
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8))
        tokens.append(list(out[0].outputs[0].token_ids))
        llm.engine.shutdown()
    return {"start_s": starts, "tokens": tokens}


def _measure(method: str, tp: int, engines: int) -> dict[str, Any]:
    """One fresh process with ``method``; what :func:`_child` returned."""
    env = {**os.environ, "SERVELAB_WORKER_MULTIPROC_METHOD": method}
    code = ("import json, sys; from experiments.engine.bench_startup import _child; "
            f"print('RESULT ' + json.dumps(_child({tp}, {engines})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{method} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rounds; print the table; return (and ``--json-out``) the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size of each engine")
    parser.add_argument("--engines", type=int, default=3, help="engines built one after the other per process")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs every method once, alternating")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for method in METHODS if r % 2 == 0 else METHODS[::-1]:
            runs[method].append(_measure(method, args.tp, args.engines))
            print(f"round {r} {method}: " + ", ".join(f"{s:.1f}" for s in runs[method][-1]["start_s"]) + " s",
                  flush=True)
    summary = {}
    for method, results in runs.items():
        first = [res["start_s"][0] for res in results]
        later = [s for res in results for s in res["start_s"][1:]]
        summary[method] = {"first_s": statistics.median(first), "later_s": statistics.median(later) if later else None}
    tokens = {json.dumps(res["tokens"]) for results in runs.values() for res in results}
    report = {"machine": machine_info(), "code": code_state(), "args": vars(args), "runs": runs, "summary": summary,
              "same_tokens": len(tokens) == 1}
    rows = [(m, f"{s['first_s']:.1f}", "-" if s["later_s"] is None else f"{s['later_s']:.1f}")
            for m, s in summary.items()]
    print(markdown_table(("method", "first engine start (s)", "later engine start (s)"), rows))
    fs, sp = summary["forkserver"], summary["spawn"]
    print(f"spawn / forkserver: first {sp['first_s'] / fs['first_s']:.2f}x" + (
        f", later {sp['later_s'] / fs['later_s']:.2f}x" if fs["later_s"] else "") +
        f"; tokens equal: {report['same_tokens']}; {report['machine']['cpu']} ({report['machine']['isa']})")
    write_json(args.json_out, report)
    return report


if __name__ == "__main__":
    main()
