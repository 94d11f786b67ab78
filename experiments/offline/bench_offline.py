"""Offline throughput: servelab's engine vs transformers static batching vs transformers continuous batching.

All systems run in ONE process on the same model, the same prompt token ids and the same output
lengths, greedy, with every request emitting exactly its own output length:

* ``ours``      ``LLM(...).generate`` with ``SamplingParams(temperature=0, max_tokens=N_i, ignore_eos=True)``.
* ``hf_static`` ``model.generate`` on left-padded (sub-)batches with ``min_new_tokens = max_new_tokens``;
  a sub-batch must run ``max(N_i)`` steps for everyone, so it reports *raw* tokens (what it computed)
  and *useful* tokens (each request's own ``N_i``; the rest is discarded).
* ``hf_cb``     transformers continuous batching (``model.generate_batch``; per-request lengths go through
  the same manager's ``add_request(max_new_tokens=N_i)``) with ``eos_token_id=-1`` (never stops early).

Workloads: ``fixed`` (every prompt ``--input-len`` tokens, every output ``--output-len`` tokens) and
``mixed`` (input lengths uniform in ``[input_len/4, 2*input_len]``, output lengths uniform in
``[--min-output-len, --max-output-len]``, seeded). Prompts are real text from ``data/prompts.txt``
(prompt ``i`` starts with line ``i``; later lines are appended as filler, then truncated to the length).

Throughput = output tokens / wall seconds of the generate call (warm: each system first runs a tiny
warmup generate). ``ratio`` = ours' useful tok/s divided by the system's useful tok/s.

Example::

    .venv/bin/python -m experiments.offline.bench_offline --workload fixed --num-prompts 64 --output-len 128 \
        --json-out experiments/results/offline_fixed.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from experiments.common import (
    add_model_workload_args,
    code_state,
    load_workload,
    machine_info,
    set_thread_env,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# --threads N also sets OMP/MKL_NUM_THREADS before torch loads, so helper threads (hf_cb's loop) get N too
for _i, _a in enumerate(sys.argv):
    _n = _a.split("=", 1)[1] if _a.startswith("--threads=") else (
        sys.argv[_i + 1] if _a == "--threads" and _i + 1 < len(sys.argv) else None)
    if _n and _n.isdigit():
        set_thread_env(int(_n))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

SYSTEMS = ("ours", "hf_static", "hf_cb")
console = Console()


# ---------------------------------------------------------------------------------------------
# systems
# ---------------------------------------------------------------------------------------------
def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_ours(prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from framework.core.sampling_params import SamplingParams
    from framework.entrypoints.llm import LLM
    from framework.metrics.collector import MetricsCollector

    kwargs: dict[str, Any] = {"enable_prefix_caching": args.prefix_caching == "on"}
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.compile:
        kwargs["compile"] = True
    if getattr(args, "attention_params", None):  # e.g. {"compile": false}: the attention kernel eager
        kwargs["attention_params"] = args.attention_params
    llm = LLM(model=args.model, dtype=args.dtype, **kwargs)
    if args.warmup:
        llm.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.engine.metrics = MetricsCollector()  # drop the warmup's steps
    llm.engine.metrics.compile_stats = llm.engine.runner.compile_stats  # keep reporting compile time/recompiles
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    summary = llm.engine.metrics.summary()
    step_split = {k: summary[k] for k in ("num_steps", "step_s", "schedule_s", "prepare_s", "forward_s",
                                          "sample_s", "update_s", "schedule_frac", "prepare_frac",
                                          "forward_frac", "sample_frac", "update_frac", "total_cached_tokens",
                                          "peak_kv_cache_usage", "num_preemptions", "mean_tpot_ms",
                                          "mean_ttft_ms")}
    compile_info = {k: v for k, v in summary.items() if k.startswith("compile")}
    del llm
    gc.collect()
    return {"seconds": seconds, "tokens": tokens, "raw_tokens": sum(map(len, tokens)),
            "extra": {"engine_config": kwargs, "step_split": step_split, "compile": compile_info}}


def _load_hf_model(args: argparse.Namespace) -> tuple[Any, Any, int]:
    from framework.model_executor.model_loader import load_model

    loaded = load_model(args.model, dtype=args.dtype)  # transformers default attention (sdpa)
    tok = loaded.tokenizer
    eos = next(iter(sorted(loaded.eos_token_ids)), None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    return loaded, loaded.model, pad


def run_hf_static(prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    loaded, model, pad = _load_hf_model(args)
    eos = sorted(loaded.eos_token_ids)

    def generate(batch: list[list[int]], n: int) -> torch.Tensor:
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad,
                               eos_token_id=eos or None, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:]

    if args.warmup:
        generate([p[:16] for p in prompts[:2]], 4)
    bs = args.hf_batch_size or len(prompts)
    tokens: list[list[int]] = []
    raw = 0
    t0 = time.perf_counter()
    for start in range(0, len(prompts), bs):
        batch, lens = prompts[start:start + bs], out_lens[start:start + bs]
        n = max(lens)
        gen = generate(batch, n).tolist()
        raw += len(batch) * n
        tokens += [row[:k] for row, k in zip(gen, lens)]
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "raw_tokens": raw,
            "extra": {"hf_batch_size": bs, "attn_implementation": "sdpa", "pad_token_id": pad}}


def run_hf_cb(prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    loaded, model, _ = _load_hf_model(args)
    page = args.cb_page_size
    num_blocks = sum(math.ceil((len(p) + n) / page) for p, n in zip(prompts, out_lens)) + 4
    cb_kwargs = {"page_size": page, "num_blocks": num_blocks,
                 "max_batch_tokens": args.max_num_batched_tokens or 2048,
                 "max_requests_per_batch": args.max_num_seqs or 256,
                 "allow_block_sharing": args.prefix_caching == "on"}

    def gen_config(n: int) -> GenerationConfig:
        # eos_token_id=-1: the CB manager's "no EOS", so every request emits exactly its max_new_tokens
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, temperature=None,
                                top_p=None, top_k=None)

    def generate(batch: list[list[int]], lens: list[int]) -> tuple[list[list[int] | None], list[str], str]:
        cfg = ContinuousBatchingConfig(**cb_kwargs)
        if len(set(lens)) == 1:
            res = model.generate_batch(inputs=batch, generation_config=gen_config(lens[0]),
                                       continuous_batching_config=cfg, progress_bar=False)
            ordered = list(res.values())
            api = "generate_batch"
        else:  # per-request lengths: the manager generate_batch drives, one add_request per prompt
            api = "continuous_batching_context_manager+add_request"
            results: dict[str, Any] = {}
            with model.continuous_batching_context_manager(generation_config=gen_config(max(lens)),
                                                           continuous_batching_config=cfg, block=True,
                                                           timeout=5) as manager:
                rids = [manager.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                        for i, (p, n) in enumerate(zip(batch, lens))]
                while len(results) < len(rids):
                    r = manager.get_result(timeout=1)
                    if r is not None and r.is_finished():
                        results[r.request_id] = r
                    elif r is None and not manager.is_running():
                        break
            ordered = [results.get(rid) for rid in rids]
        errors = [f"{getattr(r, 'request_id', '?')}: {r.error}" for r in ordered if r is not None and r.error]
        if len(ordered) != len(batch) or any(r is None for r in ordered):
            errors.append(f"only {sum(r is not None for r in ordered)}/{len(batch)} results came back")
        toks = [list(r.generated_tokens) if r is not None else None for r in ordered]
        return toks, errors, api

    if args.warmup:
        generate([p[:16] for p in prompts[:2]], [4, 4])
    t0 = time.perf_counter()
    toks, errors, api = generate(prompts, out_lens)
    seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    bad = [i for i, (t, n) in enumerate(zip(toks, out_lens)) if len(t) != n]
    if bad:
        raise RuntimeError(f"{len(bad)} requests returned a length other than max_new_tokens (first: #{bad[0]} "
                           f"{len(toks[bad[0]])} != {out_lens[bad[0]]})")
    return {"seconds": seconds, "tokens": toks, "raw_tokens": sum(map(len, toks)),
            "extra": {"api": api, "cb_config": cb_kwargs}}


RUNNERS = {"ours": run_ours, "hf_static": run_hf_static, "hf_cb": run_hf_cb}


# ---------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------
def compare(a: list[list[int]], b: list[list[int]], eos_ids: frozenset[int]) -> dict[str, Any]:
    """Token-for-token agreement of two systems' outputs (same order, same lengths expected)."""
    exact = 0
    until_eos = 0
    prefixes = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
        exact += int(x == y)
        first_eos = next((i for i, t in enumerate(x) if t in eos_ids), len(x))  # a's first EOS id
        until_eos += int(k >= min(first_eos, len(x)))
    return {"num": len(prefixes), "exact_match": exact, "match_until_first_eos_in_first": until_eos,
            "mean_common_prefix": sum(prefixes) / max(1, len(prefixes)), "min_common_prefix": min(prefixes, default=0)}


def render(results: dict[str, dict[str, Any]], useful_total: int, title: str) -> Table:
    table = Table(title=title, header_style="bold")
    for col in ("system", "raw out tokens", "useful tokens", "seconds", "raw tok/s", "useful tok/s",
                "ours / system (useful)"):
        table.add_column(col, justify="left" if col == "system" else "right")
    ours = results.get("ours", {}).get("useful_tok_s")
    for name, r in results.items():
        if r.get("error"):
            table.add_row(name, "-", "-", "-", "-", "-", f"[red]error: {r['error'][:80]}[/red]")
            continue
        ratio = f"{ours / r['useful_tok_s']:.2f}x" if ours and r["useful_tok_s"] else "-"
        table.add_row(name, str(r["raw_tokens"]), str(useful_total), f"{r['seconds']:.2f}",
                      f"{r['raw_tok_s']:.1f}", f"{r['useful_tok_s']:.1f}", ratio)
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_workload_args(p)
    p.add_argument("--max-num-seqs", type=int, default=None, help="ours (and hf_cb max_requests_per_batch); "
                   "default engine's 256")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="ours (and hf_cb max_batch_tokens); "
                   "default engine's 2048")
    p.add_argument("--prefix-caching", default="off", choices=("on", "off"),
                   help="ours' enable_prefix_caching and hf_cb's allow_block_sharing (off: compare batching only)")
    p.add_argument("--hf-batch-size", type=int, default=0, help="hf_static sub-batch size; 0 = all prompts")
    p.add_argument("--cb-page-size", type=int, default=256, help="hf_cb ContinuousBatchingConfig.page_size")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile", action="store_true", help="ours: engine compile=True (torch.compile of the "
                   "decoder at start-up; compile time and recompiles are printed and saved)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    code = code_state()  # at start: the plugin modules are imported during this run
    if args.threads:
        torch.set_num_threads(args.threads)
    from framework.model_executor.model_loader import load_model_config

    path, tokenizer, prompts, out_lens = load_workload(args)
    mc = load_model_config(args.model)
    gen_eos = json.loads((Path(path) / "generation_config.json").read_text()).get("eos_token_id") \
        if (Path(path) / "generation_config.json").is_file() else None
    eos_ids = frozenset(x for x in ([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))) | \
        frozenset([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    useful_total = sum(out_lens)
    console.print(f"[bold]workload[/bold] {args.workload}: {len(prompts)} prompts, input tokens "
                  f"{sum(map(len, prompts))} (min {min(map(len, prompts))}, max {max(map(len, prompts))}), "
                  f"output tokens {useful_total} (min {min(out_lens)}, max {max(out_lens)}); model {args.model} "
                  f"({mc.model_type}, {args.dtype}); torch threads {torch.get_num_threads()}")

    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name in args.systems.split(","):
        console.print(f"[bold]running {name}[/bold] ...")
        load_before = _load_avg()
        try:
            r = RUNNERS[name](prompts, out_lens, args)
        except Exception as exc:  # report, do not crash: the other systems still run
            msg = f"{type(exc).__name__}: {exc}"
            console.print(f"[red]{name} failed: {msg}[/red]")
            traceback.print_exc()
            results[name] = {"error": msg, "loadavg_1m_before": load_before}
            continue
        gc.collect()  # the system's model is unreferenced now
        tokens = r.pop("tokens")
        outputs[name] = tokens
        short = sum(len(t) < n for t, n in zip(tokens, out_lens))
        r.update(useful_tokens=useful_total, raw_tok_s=r["raw_tokens"] / r["seconds"],
                 useful_tok_s=useful_total / r["seconds"], num_short_outputs=short,
                 loadavg_1m_before=load_before, loadavg_1m_after=_load_avg())
        results[name] = r
        console.print(f"  {name}: {r['seconds']:.2f} s, {r['useful_tok_s']:.1f} useful tok/s"
                      + (f" [red]({short} outputs shorter than asked)[/red]" if short else ""))

    correctness = {}
    if "ours" in outputs:
        for other in ("hf_static", "hf_cb"):
            if other in outputs:
                correctness[f"ours_vs_{other}"] = compare(outputs["ours"], outputs[other], eos_ids)
        if "hf_static" in outputs and "hf_cb" in outputs:
            correctness["hf_cb_vs_hf_static"] = compare(outputs["hf_cb"], outputs["hf_static"], eos_ids)

    title = (f"offline throughput: {args.workload}, {len(prompts)} prompts, {args.dtype}, "
             f"{torch.get_num_threads()} threads")
    console.print(render(results, useful_total, title))
    if "ours" in results and "extra" in results["ours"]:
        s = results["ours"]["extra"]["step_split"]
        console.print("ours step split: " + ", ".join(
            f"{p} {s[p + '_s']:.2f}s ({100 * s[p + '_frac']:.1f}%)"
            for p in ("schedule", "prepare", "forward", "sample", "update")) + f"; {s['num_steps']} steps")
        c = results["ours"]["extra"]["compile"]
        if c:
            console.print(f"ours compile: active={c['compile_active']}, warm-up {c['compile_s']:.1f} s "
                          f"({c['compile_num_graphs_warmup']} graphs), {c['compile_num_recompiles']} recompiles "
                          f"after warm-up" + (f", fallback: {c['compile_fallback']}" if c["compile_fallback"] else ""))
    for key, c in correctness.items():
        console.print(f"{key}: {c['exact_match']}/{c['num']} identical, {c['match_until_first_eos_in_first']}/"
                      f"{c['num']} identical up to the first's first EOS, mean common prefix "
                      f"{c['mean_common_prefix']:.1f} tokens")

    report = {"args": vars(args), "machine": machine_info(), "code": code,
              "workload": {"num_prompts": len(prompts), "input_tokens": sum(map(len, prompts)),
                           "input_lens": [len(p) for p in prompts], "output_lens": out_lens,
                           "useful_output_tokens": useful_total},
              "results": results, "correctness": correctness,
              "note": "wall-clock on a shared machine; other processes (e.g. tests) add noise, see loadavg_*"}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {args.json_out}")
    return report


if __name__ == "__main__":
    main()
