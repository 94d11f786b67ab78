"""Attention with the layer features SDPA lacks — logit softcapping and sinks — as explicit torch math.

Used by the ``torch`` reference backend (and through it by ``torch_paged``'s prefill chunks and small
decode batches) for layers that need either feature; plain and sliding-window layers keep SDPA.
The semantics are transformers 5's ``eager_attention_forward`` of Gemma 2 and gpt-oss:

- softcap ``c`` (Gemma 2): ``scores = c * tanh(scores / c)`` after scaling, before the mask;
- sinks (gpt-oss ``s_aux``, one learned logit per query head): the sink joins the softmax as one
  more column and is dropped after it, so it only grows the denominator (Xiao et al., "Efficient
  Streaming Language Models with Attention Sinks", ICLR 2024, as a learned logit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerMath:
    """One layer's softmax scale and features for one call (``AttentionBackend.forward``'s keywords)."""

    scale: float  # softmax scale
    window: int | None = None  # sliding window W (keys at positions > q - W), applied through the mask
    softcap: float | None = None  # attention-logit softcap c
    sinks: torch.Tensor | None = None  # (num_heads,) learned sink logits


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       layer: LayerMath) -> torch.Tensor:
    """Scores, softcap, mask, softmax with sinks, weighted values — in float32, GQA without repeating K/V.

    Args:
        q: ``[R, Q, H, D]`` queries (``Q`` rows per request, padded).
        k, v: ``[R, KVH, S, D]`` keys and values of each request (``H`` a multiple of ``KVH``).
        mask: ``[R, Q, S]`` bool, True = attend (every row has at least one True).
        layer: scale and features; ``layer.window`` must already be in ``mask``.

    Returns:
        ``[R, Q, H, D]`` in ``q.dtype``.
    """
    num_reqs, num_q, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    q5 = q.float().view(num_reqs, num_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)  # [R, KVH, G, Q, D]
    scores = torch.matmul(q5, k.float()[:, :, None].transpose(-1, -2)) * layer.scale  # [R, KVH, G, Q, S]
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    if layer.sinks is not None:
        sink = layer.sinks.float().view(1, num_kv_heads, group, 1, 1).expand(num_reqs, -1, -1, num_q, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    out = torch.matmul(probs, v.float()[:, :, None])  # [R, KVH, G, Q, D]
    return out.permute(0, 3, 1, 2, 4).reshape(num_reqs, num_q, num_heads, head_size).to(q.dtype)
