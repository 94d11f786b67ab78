"""Profile a few engine steps: per-step times, the engine's step split, cProfile and torch.profiler.

Runs the ``fixed`` workload of ``bench_offline.py`` (same prompts) through ``LLMEngine.step`` by hand:
the first steps (prefill) are timed, then ``--steps`` decode steps run under cProfile and
``--torch-steps`` more under ``torch.profiler``; prints the top entries of each.

    .venv/bin/python -m experiments.engine.profile_engine --num-prompts 64 --steps 20
    .venv/bin/python -m experiments.engine.profile_engine --num-prompts 64 --compile --kernel-profile --skip-steps 50

``--whole-run`` instead profiles one whole ``generate`` of the workload (prefill, decode and the
draining tail) and prints its self CPU time split by :func:`time_category`: oneDNN GEMMs, the
in-place attention kernel, prefill SDPA, other generated kernels, the compiled graphs' Python
wrapper, everything else::

    .venv/bin/python -m experiments.engine.profile_engine --workload mixed --compile --kernel-profile --prefix-caching on --whole-run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from experiments.common import add_model_workload_args, build_workload, load_texts, reset_prefix_cache  # noqa: E402

#: (category, test on a torch.profiler event name), first match wins; see :func:`time_category`.
CATEGORIES = (
    ("oneDNN GEMMs", lambda n: "linear_pointwise" in n),
    # the generated kernel holding the softmax max (``amax``): paged_attention's score/softmax/value loops
    ("in-place attention kernel", lambda n: n.startswith("graph_") and "amax" in n),
    ("prefill SDPA", lambda n: "scaled_dot_product" in n),
    ("other generated kernels", lambda n: n.startswith("graph_")),
    ("compiled graph wrapper", lambda n: "CompiledFxGraph" in n),
)


def time_category(name: str) -> str:
    """The :data:`CATEGORIES` entry of a torch.profiler event name (``other`` if none).

    Generated kernels are named only with ``--kernel-profile`` (without it their time counts as
    the compiled graph's wrapper).
    """
    return next((cat for cat, test in CATEGORIES if test(name)), "other")


def whole_run_split(llm: Any, prompts: list[list[int]], out_lens: list[int]) -> list[str]:
    """Profile one ``llm.generate`` of the workload; report lines of self CPU seconds per category.

    The prefix cache is reset first (as ``bench_vs_vllm.py`` does before each generate), so the run
    finds only the prefixes its own prompts share, not the warm-up's.

    Raises:
        RuntimeError: the engine refused the reset (it still held KV blocks).
    """
    from framework.core.sampling_params import SamplingParams

    reset_prefix_cache(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        wall = time.perf_counter() - t0
    seconds: dict[str, float] = {}
    for event in tp.key_averages():
        cat = time_category(event.key)
        seconds[cat] = seconds.get(cat, 0.0) + event.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    lines = [f"whole run: {wall:.2f} s wall under the profiler, {sum(out_lens) / wall:.1f} output tok/s"]
    lines += [f"  {cat:<28}{sec:8.2f} s {100 * sec / total:6.1f}%" for cat, sec in
              sorted(seconds.items(), key=lambda kv: -kv[1])]
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_workload_args(p)
    p.add_argument("--steps", type=int, default=20, help="decode steps under cProfile")
    p.add_argument("--torch-steps", type=int, default=5, help="decode steps under torch.profiler")
    p.add_argument("--prefix-caching", default="off", choices=("on", "off"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--attention", default="torch_paged", help="attention backend: torch_paged (default) | torch")
    p.add_argument("--compile", action="store_true", help="engine.compile=true (torch.compile of the decoder)")
    p.add_argument("--kernel-profile", action="store_true", help="with --compile: name each inductor-generated "
                   "C++ kernel in the torch.profiler tables (torch._inductor.config.cpp.enable_kernel_profile)")
    p.add_argument("--skip-steps", type=int, default=0, help="decode steps to run unprofiled first (longer context)")
    p.add_argument("--out", default=None, help="write the report text here too")
    p.add_argument("--whole-run", action="store_true", help="profile one whole generate of the workload and "
                   "print its time by category (see time_category), instead of the step profiles")
    args = p.parse_args()
    if args.kernel_profile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    if args.threads:
        torch.set_num_threads(args.threads)

    from framework.core.sampling_params import SamplingParams
    from framework.entrypoints.llm import LLM
    from framework.metrics.collector import MetricsCollector

    kw = {"enable_prefix_caching": args.prefix_caching == "on"}
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=args.model, dtype=args.dtype, attention=args.attention, compile=args.compile, **kw)
    prompts, out_lens = build_workload(llm.get_tokenizer(), load_texts(Path(args.prompts_file)), args)
    llm.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    if args.whole_run:
        for line in whole_run_split(llm, prompts, out_lens):
            print(line, flush=True)
        return
    engine = llm.engine
    engine.metrics = MetricsCollector()
    for i, (pr, n) in enumerate(zip(prompts, out_lens)):
        engine.add_request(f"p{i}", pr, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    def step() -> float:
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    # prefill steps: until every request has sampled its first token
    prefill_times = []
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        prefill_times.append(step())
    say(f"prefill: {len(prefill_times)} steps, " + ", ".join(f"{t * 1000:.0f}ms" for t in prefill_times))
    pre = engine.metrics.summary()
    say("prefill split: " + ", ".join(f"{k} {pre[k + '_s']:.3f}s" for k in
                                      ("schedule", "prepare", "forward", "sample", "update")))

    for _ in range(args.skip_steps):
        engine.step()
    engine.metrics = MetricsCollector()
    prof = cProfile.Profile()
    prof.enable()
    dec_times = [step() for _ in range(args.steps)]
    prof.disable()
    s = engine.metrics.summary()
    say(f"decode ({args.num_prompts} running): {args.steps} steps, mean {1000 * sum(dec_times) / len(dec_times):.1f} "
        f"ms/step (under cProfile), {args.num_prompts * len(dec_times) / sum(dec_times):.1f} tok/s")
    say("decode split (metrics.summary): " + ", ".join(f"{k} {s[k + '_s']:.3f}s ({100 * s[k + '_frac']:.1f}%)"
                                                      for k in ("schedule", "prepare", "forward", "sample",
                                                                "update")))
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
    say("---- cProfile, by tottime ----")
    say(buf.getvalue())
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.top)
    say("---- cProfile, by cumulative ----")
    say(buf.getvalue())

    t0 = time.perf_counter()
    plain = [step() for _ in range(args.torch_steps)]
    say(f"decode without profiler: {args.torch_steps} steps, mean {1000 * sum(plain) / len(plain):.1f} ms/step "
        f"({time.perf_counter() - t0:.2f}s)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as tp:
        for _ in range(args.torch_steps):
            step()
    say("---- torch.profiler, by self CPU time ----")
    say(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    say("---- torch.profiler, by self CPU time, grouped by input shape ----")
    say(tp.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
