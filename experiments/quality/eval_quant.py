"""Cost and quality of every quant method in one run: weight bytes, KV blocks at a fixed byte budget,
perplexity on a fixed held-out text, greedy agreement with ``quant=none``, offline tok/s at batch 1 and
batch N, ms/token at batch 1.

* weight bytes: every parameter/buffer of the engine's model (tied tensors once; torchao tensors by
  their inner int8/fp8 data + scales) before (``quant=none``) and after.
* KV blocks: ``kv_cache_memory_bytes=--kv-budget`` for each ``engine.kv_cache_dtype`` (auto/int8/fp8_e4m3).
* perplexity: transformers model + the same transform, on ``pydoc_data.topics`` (sorted topics joined,
  first ``--ppl-chars`` characters; depends only on the Python minor version), disjoint 256-token windows.
* KV greedy agreement: the same first-divergence numbers for each ``kv_cache_dtype`` vs ``auto``.
* greedy agreement: engine greedy (``--output-len`` tokens, ignore_eos) over ``data/prompts.txt`` vs the
  ``quant=none`` engine; first divergence position per prompt (mean, min) and exact-match fraction.
* speed: warm ``LLM.generate`` wall time, output tokens / s, batch 1 (first prompt) and batch
  ``--batch`` (first ``--batch`` prompts), same process, same settings for every method.

Example (SmolLM2, the lead's quiet machine)::

    OMP_NUM_THREADS=2 .venv/bin/python -m experiments.quality.eval_quant --model smollm2 --dtype bfloat16 \
        --batch 64 --output-len 64 --json-out experiments/results/eval_quant_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from experiments.common import REPO_ROOT  # noqa: E402
from framework import LLM, registry  # noqa: E402
from framework.core.sampling_params import SamplingParams  # noqa: E402
from plugins.quant._common import weight_bytes  # noqa: E402
from plugins.quant._eval import heldout_text, perplexity  # noqa: E402

METHODS = ("none", "int8_wo", "int4_wo", "w8a8", "fp8")
KV_DTYPES = ("auto", "int8", "fp8_e4m3")


def _first_divergence(ref: list[int], got: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))


def _timed_tok_s(llm: LLM, prompts: list[str], output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def _perplexity(args: argparse.Namespace, method: str, params: dict, tokenizer) -> float:
    from transformers import AutoModelForCausalLM

    from framework.model_executor.model_loader import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=getattr(torch, args.dtype))
    if method != "none":
        model = registry.create("quant", method, **params).apply(model)
    return perplexity(model.eval(), tokenizer(heldout_text(args.ppl_chars))["input_ids"])


def evaluate(args: argparse.Namespace) -> dict:
    """Run every method in ``args.methods``; returns ``{"kv": {...}, "methods": {name: {...}}}``."""
    prompts = [line.strip() for line in open(args.prompts_file) if line.strip()]
    common = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  enable_prefix_caching=False)
    result: dict = {"kv": {}, "methods": {}, "python": platform.python_version(), "torch": torch.__version__}
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    kv_reference = None
    for kv in KV_DTYPES:
        llm = LLM(kv_cache_dtype=kv, kv_cache_memory_bytes=args.kv_budget, **common)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        kv_reference = kv_reference or tokens
        div = [_first_divergence(r, g) for r, g in zip(kv_reference, tokens)]
        result["kv"][kv] = {"num_blocks": llm.engine.kv_allocator.num_blocks, "budget_bytes": args.kv_budget,
                            "first_divergence_mean": sum(div) / len(div), "first_divergence_min": min(div)}
        print("kv_cache_dtype", kv, json.dumps(result["kv"][kv]), flush=True)
        del llm
    reference = None
    for method in args.methods.split(","):
        params = json.loads(args.int4_params) if method == "int4_wo" else {}
        llm = LLM(quant=method, quant_params=params, **common)
        row = {"weight_bytes": weight_bytes(llm.engine.runner.model)}
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
        reference = reference or tokens
        div = [_first_divergence(r, g) for r, g in zip(reference, tokens)]
        row.update(first_divergence_mean=sum(div) / len(div), first_divergence_min=min(div),
                   exact_match=sum(d == args.output_len for d in div) / len(div))
        row["tok_s_batch1"] = _timed_tok_s(llm, prompts[:1], args.output_len)
        row["ms_per_token_batch1"] = 1000.0 / row["tok_s_batch1"]
        batch = (prompts * (-(-args.batch // len(prompts))))[:args.batch]
        row[f"tok_s_batch{args.batch}"] = _timed_tok_s(llm, batch, args.output_len)
        row["perplexity"] = _perplexity(args, method, params, llm.engine.tokenizer)
        result["methods"][method] = row
        print(method, json.dumps(row), flush=True)
        del llm
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--methods", default=",".join(METHODS), help="comma list; the first is the agreement reference")
    p.add_argument("--int4-params", default='{"group_size": 64}',
                   help="JSON quant.params for int4_wo (stories260K: "
                        '\'{"group_size": 32, "skip": ["gate_proj", "up_proj", "down_proj"]}\')')
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-budget", type=int, default=64 << 20, help="bytes")
    p.add_argument("--ppl-chars", type=int, default=20000)
    p.add_argument("--prompts-file", default=str(REPO_ROOT / "data" / "prompts.txt"))
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = evaluate(args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
