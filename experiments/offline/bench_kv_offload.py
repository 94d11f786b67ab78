"""KV offload benchmark: a multi-turn workload at a KV budget it thrashes, ``kv_connector=offload`` on vs off.

Conversations of random token ids (``--first-len`` tokens, then ``--turn-len`` new tokens per turn); every turn's
prompt is the previous turn's prompt, its output (``--output-len`` tokens, greedy, ``ignore_eos``) and the new
tokens, as a chat client resends its history. Turn ``k`` of every conversation is one ``generate`` call (they
arrive together), turns in order. ``--num-blocks`` is the engine's KV budget: pick it below the conversations'
working set (the script prints the working set in blocks) so the local prefix cache loses earlier turns.

Systems, same prompts:

* ``recompute`` — ``kv_connector=none``: what the local prefix cache lost is computed again;
* ``offload``   — ``kv_connector=offload`` with ``--cpu-bytes`` (and ``--disk-path``/``--disk-bytes``): earlier
  turns' blocks load from the CPU (or disk) tier.

Reported per system: the offload tier's hit rate (``external_prefix_cache_hits / external_prefix_cache_queries``,
tokens), the local prefix cache's, TTFT p50/p99 (s), output tok/s over the whole run, whether the output tokens
equal the other system's, and the machine (CPU name and ISA flags, ``experiments.common.machine_info``).

Example::

    .venv/bin/python -m experiments.offline.bench_kv_offload --model smollm2 --dtype bfloat16 --threads 2 \\
        --num-conversations 8 --turns 4 --first-len 256 --turn-len 64 --output-len 32 --num-blocks 96 \\
        --json-out docs/results/kv_offload.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from experiments.common import bench_dtype, code_state, machine_info, markdown_table, set_thread_env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=256, help="tokens of a conversation's first prompt")
    p.add_argument("--turn-len", type=int, default=64, help="new tokens per later turn")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=96, help="the engine's KV budget, blocks (thrashing: below the "
                   "working set the script prints)")
    p.add_argument("--cpu-bytes", type=int, default=1 << 30, help="offload CPU tier, bytes")
    p.add_argument("--disk-path", default=None, help="offload disk tier folder (none: no disk tier)")
    p.add_argument("--disk-bytes", type=int, default=0, help="offload disk tier, bytes")
    p.add_argument("--systems", default="recompute,offload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="OMP/MKL threads; 0 = unchanged")
    p.add_argument("--attention-params", default="{}", help="the attention backend's params as JSON, e.g. "
                   '\'{"compile": false}\' (the torch_paged kernel eager: no start-up compile, smoke runs)')
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def max_model_len(args: argparse.Namespace) -> int:
    """Tokens of a conversation's last turn, prompt and output."""
    return args.first_len + (args.turns - 1) * (args.turn_len + args.output_len) + args.output_len


def run_system(system: str, args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    """One system over the whole workload: its metrics and every turn's output token ids."""
    from framework import LLM, SamplingParams
    from framework.metrics.collector import percentile

    kwargs: dict[str, Any] = {}
    if system == "offload":
        kwargs = {"kv_connector": "offload", "kv_connector_params": {
            "cpu_bytes": args.cpu_bytes, "disk_path": args.disk_path, "disk_bytes": args.disk_bytes}}
    llm = LLM(model=args.model, dtype=dtype, block_size=args.block_size, num_blocks=args.num_blocks,
              max_model_len=max_model_len(args), attention_params=json.loads(args.attention_params), **kwargs)
    vocab = llm.engine.tokenizer.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.first_len)] for _ in range(args.num_conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    outputs, ttfts, num_out = [], [], 0
    start = time.perf_counter()
    for _ in range(args.turns):
        results = llm.generate(prompts, params)
        for i, result in enumerate(results):
            tokens = list(result.outputs[0].token_ids)
            outputs.append(tokens)
            num_out += len(tokens)
            if result.metrics is not None and result.metrics.ttft_s is not None:
                ttfts.append(result.metrics.ttft_s)
            prompts[i] = prompts[i] + tokens + [rng.randrange(3, vocab) for _ in range(args.turn_len)]
    wall_s = time.perf_counter() - start
    summary = llm.engine.metrics.summary()
    kv = llm.engine.scheduler.kv.stats()
    queries = summary.get("external_prefix_cache_queries", 0)
    return {"system": system, "outputs": outputs, "output_tok_s": num_out / wall_s, "wall_s": wall_s,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "offload_hit_rate": summary.get("external_prefix_cache_hits", 0) / queries if queries else 0.0,
            "local_hit_rate": kv.prefix_hits_tokens / kv.prefix_queries_tokens if kv.prefix_queries_tokens else 0.0,
            "num_preemptions": llm.engine.metrics.num_preemptions}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the systems, print a table, write ``--json-out``; returns the result."""
    args = parse_args(argv)
    set_thread_env(args.threads)
    dtype = bench_dtype(args.model, args.dtype)
    working_set = args.num_conversations * -(-max_model_len(args) // args.block_size)
    print(f"working set {working_set} blocks (all conversations' last turns), KV budget {args.num_blocks} blocks")
    runs = [run_system(s, args, dtype) for s in args.systems.split(",")]
    same = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    rows = [[r["system"], f"{r['offload_hit_rate']:.2f}", f"{r['local_hit_rate']:.2f}", f"{r['ttft_p50_s']:.4f}",
             f"{r['ttft_p99_s']:.4f}", f"{r['output_tok_s']:.1f}", r["num_preemptions"]] for r in runs]
    print(markdown_table(["system", "offload hit rate", "local hit rate", "TTFT p50 s", "TTFT p99 s", "output tok/s",
                          "preemptions"], rows))
    print(f"output tokens equal across systems: {same}")
    machine = machine_info()
    print(f"cpu: {machine['isa']}")
    result = {"args": vars(args), "dtype": dtype, "working_set_blocks": working_set, "same_tokens": same,
              "systems": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
              "machine": machine, "code": code_state()}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
