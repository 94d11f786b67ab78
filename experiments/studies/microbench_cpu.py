"""CPU microbenchmarks behind the CPU-speed results: the in-place decode kernel, oneDNN GEMMs by rows, prefill SDPA.

``kernel``: ``torch_paged``'s in-place kernel (``_paged_kernel.paged_attention``), compiled by inductor
with the engine's settings (``compile.inductor_config``, so FMA contraction for bf16), on decode rows
(SmolLM2 shapes: 3 KV heads x 3 query heads, head size 64, 16-token blocks) with contexts drawn in
``[context/2, context]``. It times one call per layer cache over ``--layers`` caches, which streams
them from DRAM, and the same number of calls on one cache, which stays in L3 when it fits. Block ids
are placed at random or consecutively (``--placement``). Per setting, it prints the median over rounds
of microseconds per layer.

``gemm``: oneDNN's prepacked bf16 GEMM (``mkldnn._linear_pointwise``, the engine's ``prepacked_linear``)
for SmolLM2's projections at each row count of ``--rows``, 30 calls per projection. ``dram`` cycles
through distinct weights totalling at least :data:`DRAM_BYTES` (3x this machine's 32 MiB L3), so every
call streams its weight from DRAM as in a decode step; ``l3`` repeats one weight, which stays cached.
It prints GF/s (best of ``--rounds``). ``--huge-pages`` backs the packed weights with 2 MiB transparent
huge pages first (``madvise(MADV_COLLAPSE)``, Linux >= 6.1, after the engine's ``tune_malloc``, so the
weights sit in the process heap).

``sdpa``: where the CPU flash SDPA's prefill time goes, on one padded bucket of ``torch``'s packed prefill
path (``--tiles`` query tiles of ``--tile`` tokens, each KV head's 3 query heads as ``3 * tile`` rows,
``--keys`` keys, a causal boolean mask per tile). It times SDPA in bf16, then the same attention as oneDNN
bf16 ``bmm`` for q.k and p.v with a softmax compiled by inductor in between (each part, and all three in
one compiled function; the ``bmm`` rounds scores to bf16, so this is a speed reference, not a
replacement), and, where torch is built with MKL, counts the GEMMs SDPA issues and their FLOPs from
``MKL_VERBOSE=1`` in a child process (ATen's ``cpublas::gemm`` for bf16 inputs and float32 output goes
to MKL on x86; oneDNN is not on that route), which bounds their rate from below.

    .venv/bin/python -m experiments.studies.microbench_cpu kernel --threads 2
    .venv/bin/python -m experiments.studies.microbench_cpu gemm --threads 2 --rows 1,8,16,64,2048
    .venv/bin/python -m experiments.studies.microbench_cpu sdpa --threads 2
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from experiments.common import REPO_ROOT

#: SmolLM2-135M's projections as (out_features, in_features), and how many of each a forward runs.
GEMMS = {"qkv": ((960, 576), 30), "o": ((576, 576), 30), "gate_up": ((3072, 576), 30), "gate": ((1536, 576), 30),
         "down": ((576, 1536), 30), "lm_head": ((49152, 576), 1)}
#: Least bytes of distinct weights ``gemm``'s ``dram`` setting cycles through (3x the 32 MiB L3).
DRAM_BYTES = 96 << 20
MADV_COLLAPSE = 25  # Linux >= 6.1 <sys/mman.h>
HUGE_PAGE = 2 << 20  # bytes
#: SmolLM2's attention: KV heads, query heads per KV head, head size.
ATTN_SHAPE = (3, 3, 64)


def bench_kernel(tokens: int, context: int, layers: int, placement: str, rounds: int) -> dict[str, float]:
    """Median us per layer of the compiled in-place kernel: ``dram`` (``layers`` caches) and ``l3`` (one cache)."""
    from plugins.attention import _paged_kernel as kernel
    from plugins.attention.torch_paged import _compiled_kernel, _mark_dynamic

    (kv_heads, group, head), block = ATTN_SHAPE, 16
    per_request = -(-context // block)
    num_blocks = tokens * per_request + 8
    rng = np.random.default_rng(0)
    ids = np.arange(num_blocks) if placement == "consecutive" else rng.permutation(num_blocks)
    table = torch.from_numpy(ids[: tokens * per_request].reshape(tokens, per_request).astype(np.int64))
    caches = [torch.randn(kernel.cache_shape(num_blocks, block, kv_heads, head), dtype=torch.bfloat16)
              for _ in range(layers)]
    query = torch.randn(tokens, kv_heads, group, head, dtype=torch.bfloat16)
    kv = kernel.kv_partitions(table, rng.integers(context // 2, context + 1, tokens), block)
    # the engine's compiled kernel, with the batch dims dynamic and the cache's block count static, as
    # in the compiled decoder's graphs (the opaque op's path also makes the block count symbolic)
    _mark_dynamic(kv)
    fn = _compiled_kernel()
    for cache in caches:  # warm-up: compile, and a first call on each cache
        fn(query, cache, kv, head ** -0.5)
    out = {}
    for name, pool in (("dram", caches), ("l3", caches[:1] * layers)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for cache in pool:
                fn(query, cache, kv, head ** -0.5)
            times.append((time.perf_counter() - start) / layers * 1e6)
        out[name] = statistics.median(times)
    return out


def collapse_huge_pages(weights: list[torch.Tensor]) -> int:
    """Back the 2 MiB chunks holding ``weights`` (oneDNN-packed tensors) with huge pages; returns chunks collapsed."""
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    chunks = set()
    for w in weights:
        start, nbytes = torch.ops.mkldnn.data_ptr(w), torch.ops.mkldnn._nbytes(w)
        chunks.update(range(start // HUGE_PAGE, (start + nbytes - 1) // HUGE_PAGE + 1))
    return sum(madvise(c * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) == 0 for c in sorted(chunks))


def bench_gemm(rows: int, name: str, rounds: int, huge_pages: bool = False) -> dict[str, float]:
    """GF/s of oneDNN's prepacked bf16 GEMM for projection ``name`` at ``rows`` rows (best of ``rounds``).

    Returns ``{"dram": GF/s with each call's weight streamed from DRAM, "l3": GF/s with one cached weight}``.
    """
    (n, k), count = GEMMS[name]
    distinct = max(count, -(-DRAM_BYTES // (2 * n * k)))
    weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=torch.bfloat16), rows)
               for _ in range(distinct)]
    if huge_pages:
        collapse_huge_pages(weights)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    out = {}
    for setting, pool in (("dram", weights), ("l3", weights[:1] * count)):
        best, start_at = float("inf"), 0
        for _ in range(rounds + 2):  # the first two warm up (oneDNN primitive creation)
            calls = [pool[(start_at + i) % len(pool)] for i in range(count)]  # a fresh run of weights each round
            start_at += count
            start = time.perf_counter()
            for w in calls:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            best = min(best, time.perf_counter() - start)
        out[setting] = 2 * rows * n * k * count / best / 1e9
    return out


_MKL_GEMM = re.compile(r"GEMM_BF16BF16F32\([NT],[NT],(\d+),(\d+),(\d+),")


def prefill_bucket(tiles: int, tile: int, keys: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 ``q [R, KVH, G * tile, D]``, ``k``/``v [R, KVH, keys, D]`` and the causal boolean mask
    ``[R, 1, G * tile, keys]`` of ``tiles`` query tiles that end at random positions (``torch``'s packed layout).

    Raises:
        ValueError: ``keys < tile`` (a tile's queries see themselves, so it needs at least ``tile`` keys).
    """
    if keys < tile:
        raise ValueError(f"--keys ({keys}) must be at least --tile ({tile}): a tile's queries see themselves")
    kv_heads, group, head = ATTN_SHAPE
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tiles, kv_heads, group * tile, head, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(tiles, kv_heads, keys, head, generator=gen).to(torch.bfloat16) for _ in range(2))
    first = torch.randint(0, keys - tile + 1, (tiles, 1), generator=gen) + torch.arange(tile)  # [R, tile] query positions
    mask = torch.arange(keys) <= first[..., None]  # [R, tile, keys]
    return q, k, v, mask[:, None].expand(-1, group, -1, -1).reshape(tiles, 1, group * tile, keys)


def _best_ms(fn: Callable[[], object], rounds: int, calls: int = 10) -> float:
    """Best of ``rounds`` mean wall times of ``calls`` calls of ``fn``, milliseconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def mkl_gemm_calls(tiles: int, tile: int, keys: int, threads: int) -> dict[str, float]:
    """The GEMMs one SDPA call on :func:`prefill_bucket` hands to MKL (``MKL_VERBOSE=1``, child process):
    ``calls`` and their total ``gflop``; empty when torch has no MKL or MKL printed no GEMM line. (The
    times MKL prints are not used: verbose mode's own printing inflates them.)"""
    if not torch.backends.mkl.is_available():
        return {}
    code = ("import sys, torch, torch.nn.functional as F; "
            "from experiments.studies.microbench_cpu import prefill_bucket; torch.set_num_threads(int(sys.argv[4])); "
            "q, k, v, m = prefill_bucket(*map(int, sys.argv[1:4])); "
            "[F.scaled_dot_product_attention(q, k, v, attn_mask=m) for _ in range(2)]")
    out = subprocess.run([sys.executable, "-c", code, str(tiles), str(tile), str(keys),
                          str(threads or torch.get_num_threads())], env={**os.environ, "MKL_VERBOSE": "1"},
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT).stdout
    flops = [2 * int(m) * int(n) * int(k) for m, n, k in (g.groups() for g in _MKL_GEMM.finditer(out))]
    flops = flops[len(flops) // 2:]  # the second of the two SDPA calls
    return {"calls": len(flops), "gflop": sum(flops) / 1e9} if flops else {}


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The weights for ``p.v``: softmax over keys of ``scores [R * KVH, rows, keys]`` (``q.k``, unscaled;
    head size 64) in float32, ``-inf`` where ``mask [R, 1, rows, keys]`` is False, rounded to the scores' dtype."""
    tiles, _, rows, keys = mask.shape
    s = scores.float().view(tiles, -1, rows, keys).masked_fill(~mask, float("-inf")) * ATTN_SHAPE[2] ** -0.5
    return torch.softmax(s, -1).to(scores.dtype).flatten(0, 1)


def bmm_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`prefill_bucket`'s q/k/v as ``bmm`` operands: ``q [R * KVH, rows, D]``, ``k^T [R * KVH, D, keys]``
    and ``v [R * KVH, keys, D]`` (views)."""
    return q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), v.flatten(0, 1)


def bmm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`prefill_bucket`'s attention as two ``bmm``s and :func:`masked_softmax`: ``[R, KVH, rows, D]``.

    In bf16 the ``bmm``s run on oneDNN and round the scores to bf16 (CPU ``bmm`` has no float32 output).
    """
    qf, kt, vf = bmm_operands(q, k, v)
    return torch.bmm(masked_softmax(torch.bmm(qf, kt), mask), vf).view(q.shape)


def bench_sdpa(tiles: int, tile: int, keys: int, rounds: int, threads: int) -> dict[str, float]:
    """Milliseconds of SDPA and of :func:`bmm_attention` (its parts, and all compiled) on one prefill bucket,
    the ``bmm``'s GF/s, and MKL's GEMMs inside SDPA (``mkl_*``, :func:`mkl_gemm_calls`)."""
    import torch.nn.functional as F

    from plugins.attention.torch_paged import _counting_inductor  # inductor with the engine's settings

    q, k, v, mask = prefill_bucket(tiles, tile, keys)
    qf, kt, vf = bmm_operands(q, k, v)
    scores = torch.bmm(qf, kt)
    compiled_softmax = torch.compile(masked_softmax, backend=_counting_inductor)
    compiled_attention = torch.compile(bmm_attention, backend=_counting_inductor)
    probs = compiled_softmax(scores, mask)
    r = {"sdpa": _best_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rounds),
         "qk_bmm": _best_ms(lambda: torch.bmm(qf, kt), rounds),
         "pv_bmm": _best_ms(lambda: torch.bmm(probs, vf), rounds),
         "softmax": _best_ms(lambda: compiled_softmax(scores, mask), rounds),
         "bmm_attention": _best_ms(lambda: compiled_attention(q, k, v, mask), rounds)}
    r["bmm_gflops"] = 2 * scores.numel() * q.shape[-1] / r["qk_bmm"] / 1e6
    mkl = mkl_gemm_calls(tiles, tile, keys, threads)
    r.update({f"mkl_{key}": value for key, value in mkl.items()})
    if mkl:  # if SDPA were all GEMM: a floor on the rate of its MKL GEMMs
        r["mkl_gflops_floor"] = mkl["gflop"] / r["sdpa"] * 1e3
    return r


def main(argv: list[str] | None = None) -> dict:
    """Run one benchmark; returns what it printed (``{placement: {dram, l3}}``, ``{rows: {gemm: {dram, l3}}}``
    or :func:`bench_sdpa`'s dict)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench", choices=("kernel", "gemm", "sdpa"))
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads; 0 = torch default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="kernel: decode rows")
    p.add_argument("--context", type=int, default=189, help="kernel: longest context (tokens)")
    p.add_argument("--layers", type=int, default=30, help="kernel: layer caches")
    p.add_argument("--placement", default="random,consecutive", help="kernel: comma list of random|consecutive")
    p.add_argument("--rows", default="64,128,256,2048", help="gemm: comma list of M")
    p.add_argument("--gemms", default=",".join(GEMMS), help="gemm: comma list of " + "|".join(GEMMS))
    p.add_argument("--huge-pages", action="store_true", help="gemm: back the packed weights with 2 MiB huge pages")
    p.add_argument("--tiles", type=int, default=16, help="sdpa: query tiles in the bucket")
    p.add_argument("--tile", type=int, default=64, help="sdpa: query tokens per tile (the engine's prefill_tile)")
    p.add_argument("--keys", type=int, default=256, help="sdpa: keys per tile (padded)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {}
    if args.bench == "sdpa":
        r = bench_sdpa(args.tiles, args.tile, args.keys, args.rounds, args.threads)
        print(f"bucket {args.tiles} tiles x {ATTN_SHAPE[1] * args.tile} rows x {args.keys} keys: SDPA {r['sdpa']:.3f} ms | "
              f"bmm q.k {r['qk_bmm']:.3f} ms ({r['bmm_gflops']:.0f} GF/s), softmax (compiled) {r['softmax']:.3f} ms, "
              f"bmm p.v {r['pv_bmm']:.3f} ms, all three compiled {r['bmm_attention']:.3f} ms")
        if "mkl_calls" in r:
            print(f"SDPA's GEMMs (MKL, bf16 in, float32 out): {r['mkl_calls']} calls, {r['mkl_gflop']:.3f} GFLOP, "
                  f">= {r['mkl_gflops_floor']:.0f} GF/s (the rate if SDPA's whole time were GEMM)")
        return r
    if args.bench == "kernel":
        for placement in args.placement.split(","):
            r = results[placement] = bench_kernel(args.tokens, args.context, args.layers, placement, args.rounds)
            print(f"blocks {placement:<12} {args.layers} caches (DRAM) {r['dram']:7.0f} us/layer   "
                  f"one cache (L3) {r['l3']:7.0f} us/layer")
        return results
    if args.huge_pages:
        from framework.model_executor.cpu_malloc import tune_malloc

        tune_malloc()  # as the engine: packed weights in the heap, not one mmap each (too small for a huge page)
    for rows in (int(m) for m in args.rows.split(",")):
        r = results[rows] = {name: bench_gemm(rows, name, args.rounds, args.huge_pages)
                             for name in args.gemms.split(",")}
        print(f"M={rows:<6}" + "".join(f"{name} {v['dram']:4.0f} / {v['l3']:4.0f}  " for name, v in r.items())
              + "GF/s (weights from DRAM / cached)")
    return results


if __name__ == "__main__":
    main()
