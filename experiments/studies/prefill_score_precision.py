"""Prefill attention with bf16 GEMMs: score precision and time against the CPU flash SDPA.

The CPU flash SDPA reaches a tenth of the GEMM rate at the workloads' per-request lengths, and the
fast alternative, two bf16 ``bmm``s, returns the scores rounded to bf16 (CPU ``bmm`` has no float32
``out_dtype``). Rounding costs ``|s| * 2^-9`` of absolute error per score ``s``. This script measures
what that does to the output on real activations, and a remedy: shift each query row's scores by an
estimate ``c`` of the row maximum inside the GEMM (one extra column, ``[q, -c] . [k, 1]``), so that
the rounded quantity is ``s - c``, small exactly for the keys that carry the softmax's weight.
Softmax is shift-invariant, so the shift changes only the rounding. ``c`` is the larger of the
row's score with the first key (the attention sink) and with its own key, both cheap to compute.

It captures each request's q/k/v from a transformers forward of ``bench_offline.py``'s prompts (a
transformers attention hook, ``--layers`` of them), and for every variant prints the output error
against a float64 reference (relative L2 per request and layer: median and max; max absolute) and
the best of ``--rounds`` timings over all requests and layers, eager and (unless ``--no-compile``)
compiled by inductor with dynamic shapes, and (also unless ``--no-compile``) ``flex_attention`` in
float32 (:func:`flex_fp32`)::

    .venv/bin/python -m experiments.studies.prefill_score_precision --workload mixed --requests 13 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from experiments.common import add_model_workload_args, build_workload, load_texts  # noqa: E402

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [H, p, D], k and v [KVH, p, D] of one request and layer


def capture_qkv(model_path: str, prompts: list[list[int]], layers: list[int], dtype: torch.dtype) -> list[QKV]:
    """Each prompt's post-RoPE q/k/v at ``layers`` (one transformers forward per prompt, no batching)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: list[QKV] = []

    def capture(module, query, key, value, attention_mask, **kwargs):  # [1, H, p, D], [1, KVH, p, D] x2
        seen.append((query[0].clone(), key[0].clone(), value[0].clone()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("servelab_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="servelab_capture")
    out: list[QKV] = []
    with torch.no_grad():
        for ids in prompts:
            seen.clear()
            model(torch.tensor([ids]))
            out.extend(seen[layer] for layer in layers if layer < len(seen))
    return out


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA with GQA (float32 scores inside the CPU flash kernel): ``[H, p, D]``."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]


def bf16_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shift: bool) -> torch.Tensor:
    """Causal attention from two ``bmm``s in ``q``'s dtype (GQA heads packed as query rows): ``[H, p, D]``.

    Scores leave the first ``bmm`` rounded to ``q.dtype``; softmax runs in float32 and its weights are
    rounded back for the second ``bmm``, as SDPA's flash kernel does. With ``shift``, each row's scores
    are computed as ``s - c`` inside the GEMM (module docstring).
    """
    heads, length, dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    rows = q.reshape(kv_heads, group * length, dim) * dim ** -0.5  # [KVH, G*p, D]; a power-of-two scale is exact
    keys = k
    if shift:
        own = (rows.float().view(kv_heads, group, length, dim) * k.float()[:, None]).sum(-1).view(kv_heads, -1)
        first = rows.float() @ k[:, 0].float()[:, :, None]  # [KVH, G*p, 1]
        c = torch.maximum(own, first[..., 0]).to(q.dtype)  # [KVH, G*p]
        rows = torch.cat([rows, -c[..., None]], -1)  # [KVH, G*p, D + 1]
        keys = torch.cat([k, torch.ones_like(k[..., :1])], -1)
    scores = torch.bmm(rows, keys.transpose(1, 2)).view(kv_heads, group, length, length).float()
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    weights = torch.softmax(scores.masked_fill(causal, float("-inf")), -1).to(q.dtype)
    return torch.bmm(weights.view(kv_heads, group * length, length), v).view(heads, length, dim)


@functools.cache
def _causal_block_mask(length: int) -> Any:
    """flex_attention's causal ``BlockMask`` for ``length`` queries and keys (CPU), one per length."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, length, length, device="cpu")


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """``flex_attention`` compiled by inductor (its CPU C++ template), dynamic in the sequence length."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def flex_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal ``flex_attention`` with GQA on float32 copies of q/k/v: ``[H, p, D]`` in ``q.dtype``.

    In float32 inductor's CPU template computes q.k with its own vectorised micro-GEMM and p.v with
    ``cpublas::brgemm``, which runs oneDNN's ukernel for float32 (AVX2 and up); for bf16 inputs both
    GEMMs of SDPA and of the bf16 template go to MKL on x86 (``microbench_cpu.py sdpa``).
    """
    out = _compiled_flex()(q[None].float(), k[None].float(), v[None].float(),
                           block_mask=_causal_block_mask(q.shape[1]), enable_gqa=True)
    return out[0].to(q.dtype)


def measure(fn: Callable[..., torch.Tensor], data: list[QKV], rounds: int) -> dict[str, float]:
    """Error against a float64 reference and the best of ``rounds`` timings (seconds) over ``data``."""
    rel, worst = [], 0.0
    for q, k, v in data:
        group = q.shape[0] // k.shape[0]
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(group, 0),
                                             v.double().repeat_interleave(group, 0), is_causal=True)
        err = fn(q, k, v).double() - ref
        rel.append((err.norm() / ref.norm()).item())
        worst = max(worst, err.abs().max().item())
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for q, k, v in data:
            fn(q, k, v)
        best = min(best, time.perf_counter() - start)
    return {"rel_median": statistics.median(rel), "rel_max": max(rel), "abs_max": worst, "seconds": best}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print and return each variant's error and time (keys: ``sdpa``, ``bf16``, ``bf16_shift``, and
    unless ``--no-compile`` the ``compiled_`` versions of the last two and ``flex_fp32``)."""
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_workload_args(p)
    p.add_argument("--requests", type=int, default=13, help="prompts used (every num_prompts/requests-th one)")
    p.add_argument("--layers", default="0,5,10,15,20,25,29", help="comma list of layers captured")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    prompts, _ = build_workload(AutoTokenizer.from_pretrained(path), load_texts(Path(args.prompts_file)), args)
    chosen = prompts[:: max(1, len(prompts) // args.requests)][: args.requests]
    data = capture_qkv(path, chosen, [int(x) for x in args.layers.split(",")], getattr(torch, args.dtype))
    variants: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa": sdpa,
        "bf16": lambda q, k, v: bf16_scores(q, k, v, shift=False),
        "bf16_shift": lambda q, k, v: bf16_scores(q, k, v, shift=True),
    }
    if not args.no_compile:
        from plugins.attention.torch_paged import _counting_inductor  # inductor with the engine's settings

        for name in ("bf16", "bf16_shift"):
            variants[f"compiled_{name}"] = torch.compile(variants[name], dynamic=True, backend=_counting_inductor)
        variants["flex_fp32"] = flex_fp32
    print(f"{len(chosen)} requests ({sum(map(len, chosen))} tokens), {len(data) // len(chosen)} layers each, "
          f"dtype={args.dtype}")
    results = {}
    for name, fn in variants.items():
        r = results[name] = measure(fn, data, args.rounds)
        print(f"{name:<20} rel L2 err median {r['rel_median']:.5f} max {r['rel_max']:.5f}  max abs err "
              f"{r['abs_max']:.4f}  time {r['seconds'] * 1e3:.1f} ms")
    return results


if __name__ == "__main__":
    main()
