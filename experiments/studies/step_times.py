"""Per-step timing of a compiled servelab engine on a workload, for A/B runs of two checkouts.

Times every ``engine.step()`` of ``--num-prompts`` prompts of ``--workload`` (``fixed``: ``--output-len``
tokens each; ``mixed``: ``experiments.common.build_workload``'s mixed lengths; greedy, ``ignore_eos``, prefix caching
``--prefix-caching``, default off; on, as ``bench_vs_vllm.py`` runs, the cache is reset before each
repetition) after the compile warm-up and a small warm-up generate, and prints per repetition the prefill
seconds (steps until every request has its first token), the median and mean decode step (ms), the
total tok/s, and the decode steps grouped by batch size (rows up to 1, 2, 4, ..., 64, more). Run from another
checkout's root (e.g. a ``git worktree`` of the previous commit), it times that checkout's servelab (the working
directory comes first on ``sys.path``), so two versions can be interleaved on the same machine::

    git worktree add /tmp/base HEAD~1
    for r in /tmp/base "$PWD"; do (cd "$r" && "$OLDPWD/.venv/bin/python" -m experiments.studies.step_times --num-prompts 1); done
    for r in /tmp/base "$PWD"; do (cd "$r" && "$OLDPWD/.venv/bin/python" -m experiments.studies.step_times --num-prompts 64 --reps 1); done

``--decode-marker F`` creates ``F`` once the last repetition is three steps into its decode, so a sampling
profiler can attach to the decode phase alone (how docs/results.md's per-thread split was taken);
``--prefill-only`` gives every request one output token, so that a run is prefills alone, and the marker
is created as the last repetition starts::

    .venv/bin/python -m experiments.studies.step_times --reps 2 --output-len 256 --prefix-caching on --decode-marker /tmp/m &
    # prefills alone: .venv/bin/python -m experiments.studies.step_times --workload mixed --prefill-only --reps 4 --prefix-caching on --decode-marker /tmp/m &
    while [ ! -f /tmp/m ]; do sleep 0.2; done; perf record -e cpu-clock -F 999 -p $! -o /tmp/p.data -- sleep 8
    perf report -i /tmp/p.data --sort pid,dso -g none
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from experiments.common import add_model_workload_args, build_workload, load_texts, reset_prefix_cache
from framework import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="fixed", choices=("fixed", "mixed"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix-caching", default="off", choices=("on", "off"))
    p.add_argument("--decode-marker", default="", help="create this file at the last repetition's 3rd decode step "
                   "(a cue for an external profiler to attach: perf record -p PID, py-spy)")
    p.add_argument("--prefill-only", action="store_true", help="one output token per request: prefills alone "
                   "(--decode-marker's file is then created as the last repetition starts)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wp = argparse.ArgumentParser()
    add_model_workload_args(wp)
    wargs = wp.parse_args(["--workload", args.workload, "--num-prompts", str(args.num_prompts),
                           "--output-len", str(args.output_len)])
    llm = LLM(model=wargs.model, dtype="bfloat16", attention="torch_paged",
              enable_prefix_caching=args.prefix_caching == "on", compile=True)
    prompts, out_lens = build_workload(llm.get_tokenizer(), load_texts(Path(wargs.prompts_file)), wargs)
    llm.generate([{"prompt_token_ids": q[:16]} for q in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    if args.prefill_only:
        out_lens = [1] * len(out_lens)
    engine = llm.engine
    for rep in range(args.reps):
        reset_prefix_cache(llm)
        if args.decode_marker and args.prefill_only and rep == args.reps - 1:
            Path(args.decode_marker).touch()
        for i, (prompt, out_len) in enumerate(zip(prompts, out_lens)):
            engine.add_request(f"r{rep}_{i}", prompt, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
        prefill: list[float] = []
        decode: list[float] = []
        by_rows: dict[int, list[float]] = {}  # decode step seconds by batch-size bucket (rows up to the key)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            in_prefill = not decode and any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values())
            rows = len(engine.scheduler.running)
            t = time.perf_counter()
            engine.step()
            (prefill if in_prefill else decode).append(time.perf_counter() - t)
            if not in_prefill:
                by_rows.setdefault(min(128, 1 << max(0, rows - 1).bit_length()), []).append(decode[-1])
                if args.decode_marker and rep == args.reps - 1 and len(decode) == 3:
                    Path(args.decode_marker).touch()
        total = time.perf_counter() - t0
        steps = (f"decode median {1000 * statistics.median(decode):.1f} ms mean {1000 * statistics.mean(decode):.1f} ms "
                 f"({len(decode)} steps)" if decode else "no decode steps")
        print(f"rep{rep} prefill {sum(prefill):.2f}s ({len(prefill)} steps) {steps} total {total:.2f}s "
              f"tok/s {sum(out_lens) / total:.1f} recompiles {engine.runner.compile_stats.num_recompiles}", flush=True)
        for bucket, times in sorted(by_rows.items()):
            label = f"<= {bucket:3d}" if bucket < 128 else ">   64"
            print(f"  decode rows {label}: {len(times):4d} steps {sum(times):6.2f}s median "
                  f"{1000 * statistics.median(times):6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
