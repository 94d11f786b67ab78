"""The in-place paged attention kernel of ``torch_paged`` and its KV-cache layout.

Layout. One layer's cache is the ``(2, num_blocks, block_size, kv_heads, head_size)`` tensor of
every backend (block id on dim 1), but each block's keys are stored transposed: the key block is
``[kv_heads, head_size, block_size]`` (a view of ``kv_cache[0]``), the value block is the usual
``[block_size, kv_heads, head_size]``. With the block's positions innermost, the score loop
``q . K`` that inductor generates runs over ``head_size`` as plain multiply-adds on a vector of
``block_size`` keys (vLLM's CUDA key cache splits the head dimension in front of the block
positions for the same reason), instead of one horizontal dot product per (token, key, head):
0.64x the kernel time of the per-slot formulation at batch 64 on the 2-core CPU (SmolLM2 shapes,
caches streamed from DRAM). The weighted sum over values keeps ``head_size`` innermost.

The kernel (:func:`paged_attention`) is plain torch: ``torch.compile`` turns the block-table lookup
into indirect loads inside its generated loops (Kwon et al., SOSP'23, Sec. 4.1: no per-request copy
of the context), and it is traceable into a larger graph (the compiled decoder of
``engine.compile``). The K/V write is the op ``servelab::paged_write_kv``, which declares the cache
it mutates, so inductor keeps it in place inside a compiled graph.
"""

from __future__ import annotations

import torch


def key_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The key cache as ``[num_blocks, kv_heads, head_size, block_size]`` (a view, no copy).

    Args:
        kv_cache: one layer's ``(2, num_blocks, block_size, kv_heads, head_size)`` cache.
    """
    num_blocks, block_size, kv_heads, head_size = kv_cache.shape[1:]
    return kv_cache[0].view(num_blocks, kv_heads, head_size, block_size)


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V at ``slot_mapping`` in the layout above (mutates ``kv_cache``).

    Args:
        kv_cache: ``(2, num_blocks, block_size, kv_heads, head_size)``.
        key, value: ``(num_tokens, kv_heads, head_size)``, any float dtype (cast to the cache's).
        slot_mapping: ``(num_tokens,)`` int64, slot = block_id * block_size + offset.
    """
    block_size, kv_heads, head_size = kv_cache.shape[2:]
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    key_blocks(kv_cache)[block, :, :, offset] = key.to(kv_cache.dtype)  # advanced dims first: [T, KVH, D]
    kv_cache[1].view(-1, kv_heads, head_size).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def read_kv(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V stored at ``slots``: two ``(len(slots), kv_heads, head_size)`` tensors (copies)."""
    block_size, kv_heads, head_size = kv_cache.shape[2:]
    key = key_blocks(kv_cache)[slots // block_size, :, :, slots % block_size]
    return key, kv_cache[1].reshape(-1, kv_heads, head_size)[slots]


# write_kv as the op ``servelab::paged_write_kv``: the schema declares the cache it mutates
# (``Tensor(a!)``), so inductor calls it in place inside a compiled graph (a traced ``index_put_`` on
# the cache input made inductor copy the whole cache in every layer). Registered with
# torch.library.Library rather than torch.library.custom_op, whose Python wrapper costs ~35 us more
# per call of a mutating op (58 instead of 24 us at batch 1), once per layer and step.
_LIB = torch.library.Library("servelab", "FRAGMENT")  # noqa: TOR901 - kept alive for the process
_LIB.define("paged_write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()")
_LIB.impl("paged_write_kv", write_kv, "CompositeExplicitAutograd")


@torch.library.register_fake("servelab::paged_write_kv")
def _(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Shape-only ``servelab::paged_write_kv`` for tracing: no output (the cache is mutated)."""
    return None


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each token attends over the first ``kv_lens[t]`` keys of its request, read in place.

    Decode rows and prefill chunks alike (a chunk token's ``kv_lens`` is its position + 1, which
    makes it causal). GQA never repeats K/V: each KV head's ``G = H / KVH`` query heads are a
    broadcast dimension. Computed in float32.

    Args:
        query: ``[T, KVH, G, D]``, any float dtype.
        kv_cache: the layer's cache in this module's layout.
        block_tables: ``[T, NB]`` int64, the block table row of each token's request, padded with any
            valid block id; ``NB * block_size >= max(kv_lens)``.
        kv_lens: ``[T]`` int64 keys visible to each token, each >= 1.
        scale: softmax scale.

    Returns:
        ``[T, KVH, G, D]`` in ``query.dtype``.
    """
    q = query.float() * scale
    # a no-op view that inductor lowers only on a realised input: traced into a larger graph, the
    # scaled queries become a buffer, where otherwise their producers (RoPE's cos/sin) are inlined
    # into the score loop and recomputed for every block of keys (a 154 instead of 99 ms step)
    q = q.as_strided(q.shape, q.stride())
    k = key_blocks(kv_cache)[block_tables].permute(0, 2, 1, 3, 4).float()  # [T, KVH, NB, D, BS]
    scores = (q[:, :, :, None, :, None] * k[:, :, None]).sum(-2).flatten(3, 4)  # [T, KVH, G, S]
    key_pos = torch.arange(scores.shape[-1], device=query.device)
    scores = scores.masked_fill(key_pos >= kv_lens[:, None, None, None], float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    v = kv_cache[1][block_tables].float().flatten(1, 2).permute(0, 2, 1, 3)  # [T, KVH, S, D]
    out = (weights[..., None] * v[:, :, None]).sum(3) / weights.sum(-1, keepdim=True)
    return out.to(query.dtype)
