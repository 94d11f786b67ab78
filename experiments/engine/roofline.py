"""CPU roofline of one decode step: where the time goes next to what the machine allows.

Measures the machine (streaming memory bandwidth: a large tensor copy; GEMM peak: square matmuls
in the model dtype), then runs decode steps of the servelab engine at each ``--batch-sizes``
(context ~``--prompt-len`` tokens) with timers around every ``nn.Linear`` (LM head apart), the
attention backend's ``forward``, RMSNorm, the MLP activation and the sampler. The rest of the
forward (rotary embedding, residual adds, SwiGLU's product, embedding lookup and the Python of
transformers' modules) is "other forward"; the rest of ``LLMEngine.step`` (scheduling, input
preparation, output handling) is "engine overhead".

For each category the lower bound is max(bytes moved / bandwidth, FLOPs / GEMM peak): linears read
every weight once per step (2 x params FLOPs per token), attention reads each request's K and V
cache once, norms/activations stream their activations, sampling reads the logits.

    python -m experiments.engine.roofline --model smollm2 --dtype bfloat16 --batch-sizes 1,64 --threads 2
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

CATEGORIES = ("linears", "lm_head", "attention", "norms", "activation", "sampling")


def machine_peaks(dtype: torch.dtype, repeats: int = 5) -> dict[str, float]:
    """Streaming copy bandwidth (bytes/s, read + write counted) and GEMM peak (FLOP/s)."""
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)  # 256 MiB, well beyond the caches
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    bandwidth = 2 * src.numel() * src.element_size() / best
    a = torch.randn(2048, 2048).to(dtype)
    b = torch.randn(2048, 2048).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return {"bandwidth_bytes_s": bandwidth, "gemm_flop_s": 2 * 2048**3 / best}


class Timers:
    """Accumulates wall time per category by wrapping module/objects' callables."""

    def __init__(self) -> None:
        self.total_s: dict[str, float] = collections.defaultdict(float)
        self.on = False

    def wrap(self, obj: Any, attr: str, category: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total_s[category] += time.perf_counter() - t0

        setattr(obj, attr, timed)


def instrument(llm: Any, timers: Timers) -> None:
    """Wrap the model's linears, norms, activations, the attention backend and the sampler."""
    model = llm.engine.runner.model
    lm_head = model.get_output_embeddings()
    for module in model.modules():
        name = type(module).__name__
        if module is lm_head:
            timers.wrap(module, "forward", "lm_head")
        elif isinstance(module, torch.nn.Linear) or name.endswith("Linear"):
            timers.wrap(module, "forward", "linears")
        elif name.endswith("RMSNorm"):
            timers.wrap(module, "forward", "norms")
        elif isinstance(getattr(module, "act_fn", None), torch.nn.Module):
            timers.wrap(module.act_fn, "forward", "activation")
    timers.wrap(model, "forward", "forward_total")
    timers.wrap(llm.engine.runner.backend, "forward", "attention")
    timers.wrap(llm.engine.runner, "sampler", "sampling")


def bounds(model: Any, batch: int, context: int, kv_bytes_per_token_layer: int, peaks: dict[str, float],
           dtype_bytes: int) -> dict[str, float]:
    """Roofline lower bounds (seconds) per category for one decode step."""
    lm_head = model.get_output_embeddings()
    lin_params = sum(m.weight.numel() for m in model.modules()  # nn.Linear and PrepackedLinear (fused too)
                     if (isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear"))
                     and getattr(m, "weight", None) is not None and m is not lm_head)
    head_params = lm_head.weight.numel()
    layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    bw, peak = peaks["bandwidth_bytes_s"], peaks["gemm_flop_s"]

    def roof(nbytes: float, flops: float) -> float:
        return max(nbytes / bw, flops / peak)

    return {
        "linears": roof(lin_params * dtype_bytes, 2 * lin_params * batch),
        "lm_head": roof(head_params * dtype_bytes, 2 * head_params * batch),
        "attention": roof(batch * context * layers * kv_bytes_per_token_layer,
                          4 * batch * context * layers * hidden),
        "norms": roof((2 * layers + 1) * 2 * batch * hidden * dtype_bytes, 0),
        "activation": roof(layers * 2 * batch * model.config.intermediate_size * dtype_bytes, 0),
        "sampling": roof(batch * model.config.vocab_size * dtype_bytes, 0),
    }


def run_batch(args: argparse.Namespace, batch: int, peaks: dict[str, float]) -> list[tuple[str, float, float]]:
    """Decode steps at ``batch``: (category, measured ms/step, bound ms/step) rows."""
    from framework import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, attention=args.attention, enable_prefix_caching=False,
              max_num_seqs=max(batch, 1), grammar="none")
    engine = llm.engine
    timers = Timers()
    instrument(llm, timers)
    vocab = engine.runner.model.config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=args.warmup_steps + args.steps + 8, ignore_eos=True)
    for i in range(batch):  # distinct synthetic prompts of --prompt-len tokens
        engine.add_request(str(i), [(7 * j + 13 * i + 100) % vocab for j in range(args.prompt_len)], sp)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(args.warmup_steps):
        engine.step()
    timers.on = True
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    timers.on = False
    runner = engine.runner
    kv_bytes = runner.backend.kv_cache_bytes_per_block(1) // runner.block_size  # K and V, one layer, one token
    ctx = args.prompt_len + args.warmup_steps + args.steps // 2
    lower = bounds(runner.model, batch, ctx, kv_bytes, peaks, torch.finfo(getattr(torch, args.dtype)).bits // 8)
    ms = {c: 1e3 * timers.total_s[c] / args.steps for c in (*CATEGORIES, "forward_total")}
    rows = [(c, ms[c], 1e3 * lower[c]) for c in CATEGORIES]
    in_forward = sum(ms[c] for c in CATEGORIES if c != "sampling")
    rows.append(("other forward (rope, residuals, Python)", ms["forward_total"] - in_forward, 0.0))
    rows.append(("engine overhead (schedule, prepare, outputs)", 1e3 * wall - ms["forward_total"] - ms["sampling"], 0.0))
    rows.append(("step total", 1e3 * wall, sum(lower.values()) * 1e3))
    del llm
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention", default="torch_paged")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    peaks = machine_peaks(getattr(torch, args.dtype))
    print(f"machine: copy bandwidth {peaks['bandwidth_bytes_s'] / 1e9:.1f} GB/s, {args.dtype} GEMM peak "
          f"{peaks['gemm_flop_s'] / 1e9:.0f} GFLOP/s (2048^3), torch threads {torch.get_num_threads()}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rows = run_batch(args, batch, peaks)
        print(f"\nbatch {batch}, context ~{args.prompt_len + args.warmup_steps + args.steps // 2} tokens, "
              f"attention={args.attention}: ms per decode step")
        print(f"  {'category':46s} {'measured':>9s} {'roofline':>9s} {'ratio':>7s}")
        for cat, ms, lb in rows:
            ratio = f"{ms / lb:6.1f}x" if lb > 0 else "      -"
            print(f"  {cat:46s} {ms:9.2f} {lb:9.3f} {ratio}")


if __name__ == "__main__":
    main()
