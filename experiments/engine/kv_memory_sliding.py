"""KV memory one long request holds: a Gemma-3-shaped model vs the same shape with full attention.

Both models are built from transformers' ``Gemma3TextConfig`` with random weights and Gemma-3-1B's layer
pattern: 26 layers, every sixth one global (full attention), the other five local with a 512-token
sliding window (5:1). The width is reduced so that the 8k-token prefill runs on a laptop CPU (hidden 64,
2 query heads, 1 KV head of ``--head-dim`` channels, vocabulary 512); the KV bytes scale linearly with
``num_kv_heads * head_dim`` (Gemma-3-1B: 1 x 256, i.e. ``--head-dim 256``), the ratio does not. The
"full" twin has the same config with every layer full attention.

Each model runs one request whose context reaches ``--context-len`` tokens (a prompt, then
``--output-len`` decoded tokens) under the default allocator (``kv_cache=paged``: sliding layers keep
their own block tables and release out-of-window blocks) and prints what the engine's own metrics
report for it: KV blocks held per KV cache group at its last step, with the whole context computed
(``RequestOutput.metrics.kv_blocks``), their bytes (``metrics.kv_bytes``; a block holds ``block_size``
tokens of ``kv_cache_layers_per_block`` layers, K and V), the most it held at once
(``metrics.peak_kv_bytes``: a prefill chunk needs the window before it plus the chunk), and the
ratios. ``--allocator radix`` shows an allocator without the capability (no saving).

Usage: ``python -m experiments.engine.kv_memory_sliding [--context-len 8192] [--window 512] [--head-dim 32]``
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

GEMMA3_1B_LAYERS = 26
GLOBAL_EVERY = 6  # Gemma 3: sliding_window_pattern, one global layer per six


def build_model(folder: Path, num_layers: int, window: int, head_dim: int, full: bool, max_len: int) -> str:
    """Save a random-weight Gemma-3-shaped model (bf16) to ``folder``; ``full``: every layer full attention."""
    import torch
    import transformers

    layer_types = ["full_attention" if full or (i + 1) % GLOBAL_EVERY == 0 else "sliding_attention"
                   for i in range(num_layers)]
    config = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, vocab_size=512, max_position_embeddings=max_len,
        sliding_window=window, layer_types=layer_types, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return str(folder)


def measure(model: str, context_len: int, args: argparse.Namespace) -> dict[str, Any]:
    """One request of ``context_len - output_len`` prompt tokens and ``output_len`` output tokens (greedy, no
    EOS stop); the engine's KV metrics for it."""
    from framework import LLM, SamplingParams

    llm = LLM(model=model, dtype="bfloat16", attention=args.attention, kv_allocator=args.allocator,
              block_size=args.block_size, max_num_batched_tokens=args.chunk, max_model_len=context_len,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes, enable_prefix_caching=False)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 512) for _ in range(context_len - args.output_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    summary = llm.engine.metrics.summary()
    return {"kv_bytes": out.metrics.kv_bytes, "kv_blocks": out.metrics.kv_blocks, "peak": out.metrics.peak_kv_bytes,
            "windows": summary["kv_cache_group_windows"], "layers_per_block": summary["kv_cache_layers_per_block"],
            "bytes_per_block": summary["kv_cache_bytes_per_block"]}


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Build both models, measure both, print them and the ratio; returns the two measurements."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-len", type=int, default=8192, help="tokens of the request (prompt + output)")
    parser.add_argument("--output-len", type=int, default=16, help="decoded tokens at the end of the request")
    parser.add_argument("--window", type=int, default=512, help="sliding window of the local layers, tokens")
    parser.add_argument("--layers", type=int, default=GEMMA3_1B_LAYERS, help="decoder layers (every sixth global)")
    parser.add_argument("--head-dim", type=int, default=32, help="channels of the one KV head (Gemma-3-1B: 256)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--attention", default="torch")
    parser.add_argument("--allocator", default="paged", help="kv_cache allocator (radix: no sliding-window saving)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    args = parser.parse_args(argv)

    results = {}
    with tempfile.TemporaryDirectory(prefix="kv-memory-sliding-") as tmp:
        for name, full in (("gemma3 (5:1 local/global)", False), ("full attention", True)):
            folder = build_model(Path(tmp) / name.split()[0], args.layers, args.window, args.head_dim, full,
                                 args.context_len)
            results[name] = measure(folder, args.context_len, args)
    print(f"KV held by one {args.context_len}-token request: {args.layers} layers, window {args.window}, "
          f"1 KV head x {args.head_dim} channels, bf16, block_size {args.block_size}, kv_cache={args.allocator}")
    for name, r in results.items():
        groups = ", ".join(f"{w}: {b}" for w, b in zip(r["windows"].split(), r["kv_blocks"]))
        print(f"  {name:27s} {r['kv_bytes'] / 2**20:9.2f} MiB at the last step, peak {r['peak'] / 2**20:.2f} MiB "
              f"({sum(r['kv_blocks'])} blocks of {r['layers_per_block']} layers x {r['bytes_per_block']} bytes; "
              f"blocks per group {groups})")
    (sliding, full) = results.values()
    print(f"  ratio gemma3 / full attention: {sliding['kv_bytes'] / full['kv_bytes']:.3f} at the last step, "
          f"{sliding['peak'] / full['peak']:.3f} at the peak (prefill chunk of {args.chunk} tokens)")
    return results


if __name__ == "__main__":
    main()
