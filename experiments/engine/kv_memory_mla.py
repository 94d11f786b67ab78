"""KV bytes per token of DeepSeek's MLA: the latent cache (``engine.mla_latent_cache=true``) vs K/V expanded per head.

For DeepSeek-V2-Lite's and DeepSeek-V3's published attention dimensions (transformers config classes, no
weights), the attention backend the engine would build (``attention=torch``) says what one KV block costs
(``AttentionBackend.kv_cache_bytes_per_block``, what ``metrics.json`` reports as ``kv_cache_bytes_per_block``),
per token over all layers in bf16, next to the latent formula ``(kv_lora_rank + qk_rope_head_dim) * 2 *
num_layers``, and how many sequences of ``--context-len`` tokens fit in ``--budget-gib`` of KV cache either way.
Nothing is timed. Usage: ``python -m experiments.engine.kv_memory_mla [--context-len 4096] [--budget-gib 16]``
"""

from __future__ import annotations

import argparse

import torch

#: Published attention dimensions (config.json of deepseek-ai/DeepSeek-V2-Lite and DeepSeek-V3).
MODELS = {
    "DeepSeek-V2-Lite": ("DeepseekV2Config", dict(num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None)),
    "DeepSeek-V3": ("DeepseekV3Config", dict(num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536)),
}
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
BLOCK_SIZE = 16


def bytes_per_token(config: object, latent: bool) -> int:
    """KV bytes one token costs over all layers, bf16, as the engine's ``torch`` backend allocates them."""
    from framework.model_executor.model_families import attention_layers
    from plugins.attention.torch import TorchAttentionBackend

    layers = attention_layers(config, mla_latent_cache=latent)
    backend = TorchAttentionBackend(layers[0].num_heads, layers[0].num_kv_heads, layers[0].cache_head_size, 1.0,
                                    BLOCK_SIZE, torch.bfloat16, torch.device("cpu"), layers)
    return backend.kv_cache_bytes_per_block(len(layers)) // BLOCK_SIZE


def main(argv: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Print one markdown row per model; return model -> (latent, expanded) bytes per token."""
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-len", type=int, default=4096)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    args = parser.parse_args(argv)
    results = {}
    budget = int(args.budget_gib * 2**30)
    print(f"| model | latent B/token | formula | expanded B/token | ratio | seqs of {args.context_len} in "
          f"{args.budget_gib:g} GiB: latent / expanded |")
    print("|---|---|---|---|---|---|")
    for name, (cls, dims) in MODELS.items():
        config = getattr(transformers, cls)(**dims, **MLA)
        latent, expanded = bytes_per_token(config, True), bytes_per_token(config, False)
        formula = (MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]) * 2 * dims["num_hidden_layers"]
        fits = [budget // (b * args.context_len) for b in (latent, expanded)]
        print(f"| {name} | {latent:,} | {formula:,} | {expanded:,} | {expanded / latent:.1f}x | "
              f"{fits[0]} / {fits[1]} |")
        results[name] = (latent, expanded)
    return results


if __name__ == "__main__":
    main()
