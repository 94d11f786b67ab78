"""Ablation of the torch backend's decode kernel (``attention.params.decode_kernel``) on the
fixed offline workload: output tok/s of each kernel, one process, same prompts, plus how many
greedy outputs are identical between kernels (bf16 reductions differ, so not all are).

    .venv/bin/python -m experiments.studies.ablate_decode_attention [--model smollm2] [--num-prompts 64] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from experiments.common import add_model_workload_args, build_workload, load_texts  # noqa: E402
from framework import LLM, SamplingParams  # noqa: E402
from plugins.attention.torch import TorchAttentionBackend  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    """Run every decode kernel on the same workload and print tok/s and agreement."""
    p = argparse.ArgumentParser()
    add_model_workload_args(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, list[list[int]]] = {}
    for kernel in TorchAttentionBackend.DECODE_KERNELS:
        llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False,
                  attention_params={"decode_kernel": kernel})
        prompts, out_lens = build_workload(llm.get_tokenizer(), load_texts(Path(args.prompts_file)), args)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
        llm.generate([{"prompt_token_ids": pr[:16]} for pr in prompts[:2]], SamplingParams(max_tokens=4))  # warmup
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": pr} for pr in prompts], params)
        dt = time.perf_counter() - t0
        results[kernel] = [list(o.outputs[0].token_ids) for o in outs]
        print(f"decode_kernel={kernel:7s} {dt:7.2f} s  {sum(out_lens) / dt:7.1f} output tok/s", flush=True)
    base, *others = results
    for name in others:
        same = sum(a == b for a, b in zip(results[base], results[name]))
        print(f"identical greedy outputs {base} vs {name}: {same}/{len(results[base])}")


if __name__ == "__main__":
    main()
