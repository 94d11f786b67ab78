"""What-if: decode attention as a grouped matmul instead of ``scaled_dot_product_attention`` (CPU, bf16).

``plugins/attention/torch.py`` runs decode segments through ``F.scaled_dot_product_attention`` with
``q`` of shape ``[R, H, 1, D]``; on CPU in bfloat16 torch's flash kernel costs ~0.1 ms per request per
layer whatever the context length. This script monkeypatches ``TorchAttentionBackend._attend`` (in
this process only, the plugin file is untouched; the variants below are self-contained, so the
result does not depend on what the plugin file currently does for decodes — "plugin file as is" runs it) so decode segments compute
``softmax(q k^T * scale) v`` with GQA as a grouped batched matmul (fp32 scores and softmax), then runs
the ``fixed`` workload of ``bench_offline.py`` with and without the patch and compares outputs. A second
variant keeps SDPA but packs each KV head's query heads as query rows (``[R, KV, G, D]``, no
``enable_gqa``), which is what transformers' own sdpa path does for one-token queries (``pack_gqa``).

    .venv/bin/python experiments/try_decode_attn_patch.py --threads 1 --num-prompts 64 --output-len 128
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "experiments"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def grouped_decode_attend(self, query, key_cache, value_cache, seg):  # noqa: ANN001, ANN201
    """Drop-in for ``TorchAttentionBackend._attend``: grouped matmul for decodes, SDPA otherwise."""
    if seg.query_index is not None:
        return _ORIGINAL(self, query, key_cache, value_cache, seg)
    num_reqs = seg.block_table.shape[0]
    group = self.num_heads // self.num_kv_heads
    k = key_cache[seg.block_table].view(num_reqs, -1, self.num_kv_heads, self.head_size).transpose(1, 2)
    v = value_cache[seg.block_table].view(num_reqs, -1, self.num_kv_heads, self.head_size).transpose(1, 2)
    k, v = k.to(query.dtype), v.to(query.dtype)
    q = query.reshape(num_reqs, self.num_kv_heads, group, self.head_size)  # query heads h = kv * group + g
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale  # [R, KV, G, S]
    scores.masked_fill_(~seg.mask.view(num_reqs, 1, 1, -1), float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(num_reqs, self.num_heads, self.head_size)


def packed_gqa_decode_attend(self, query, key_cache, value_cache, seg):  # noqa: ANN001, ANN201
    """Drop-in for ``_attend``: decodes through SDPA with the query heads of each KV head packed as
    ``group`` query rows (transformers' ``pack_gqa``), no ``enable_gqa``; prefill unchanged."""
    if seg.query_index is not None:
        return _ORIGINAL(self, query, key_cache, value_cache, seg)
    num_reqs = seg.block_table.shape[0]
    group = self.num_heads // self.num_kv_heads
    k = key_cache[seg.block_table].view(num_reqs, -1, self.num_kv_heads, self.head_size).transpose(1, 2)
    v = value_cache[seg.block_table].view(num_reqs, -1, self.num_kv_heads, self.head_size).transpose(1, 2)
    k, v = k.to(query.dtype), v.to(query.dtype)
    q = query.reshape(num_reqs, self.num_kv_heads, group, self.head_size)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=self.scale)  # mask [R, 1, 1, S]
    return o.reshape(num_reqs, self.num_heads, self.head_size)


def head_sdpa_decode_attend(self, query, key_cache, value_cache, seg):  # noqa: ANN001, ANN201
    """Drop-in for ``_attend``: decodes as in commit d2fd0ea (SDPA, ``q [R, H, 1, D]``, ``enable_gqa``)."""
    if seg.query_index is not None:
        return _ORIGINAL(self, query, key_cache, value_cache, seg)
    num_reqs = seg.block_table.shape[0]
    k = key_cache[seg.block_table].view(num_reqs, -1, self.num_kv_heads, self.head_size).transpose(1, 2)
    v = value_cache[seg.block_table].view(num_reqs, -1, self.num_kv_heads, self.head_size).transpose(1, 2)
    k, v = k.to(query.dtype), v.to(query.dtype)
    o = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=seg.mask, scale=self.scale,
                                       enable_gqa=True)
    return o.transpose(1, 2)[:, 0]


_ORIGINAL = None


def main() -> None:
    global _ORIGINAL
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from bench_offline import build_workload, load_texts

    from framework.llm import LLM
    from framework.sampling_params import SamplingParams
    from plugins.attention.torch import TorchAttentionBackend

    _ORIGINAL = TorchAttentionBackend._attend
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False)
    ns = argparse.Namespace(workload="fixed", num_prompts=args.num_prompts, input_len=args.input_len,
                            output_len=args.output_len, seed=0)
    prompts, out_lens = build_workload(llm.get_tokenizer(), load_texts(REPO_ROOT / "data" / "prompts.txt"), ns)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    reqs = [{"prompt_token_ids": pr} for pr in prompts]
    llm.generate([pr[:16] for pr in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    results = {}
    variants = (("sdpa enable_gqa (d2fd0ea)", head_sdpa_decode_attend), ("sdpa packed gqa", packed_gqa_decode_attend),
                ("grouped matmul", grouped_decode_attend), ("plugin file as is", _ORIGINAL),
                ("sdpa enable_gqa, again", head_sdpa_decode_attend))
    for name, attend in variants:
        TorchAttentionBackend._attend = attend
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params)
        dt = time.perf_counter() - t0
        results[name] = [list(o.outputs[0].token_ids) for o in outs]
        print(f"{name:24s} {dt:7.2f} s  {sum(out_lens) / dt:7.1f} tok/s  (loadavg {os.getloadavg()[0]:.2f})",
              flush=True)
    TorchAttentionBackend._attend = _ORIGINAL
    a = results[variants[0][0]]
    for name, b in results.items():
        print(f"identical outputs, {variants[0][0]} vs {name}: {sum(x == y for x, y in zip(a, b))}/{len(a)}")


if __name__ == "__main__":
    main()
