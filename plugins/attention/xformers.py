"""xFormers memory-efficient attention (Rabe & Staats 2021; Lefaudeux et al., xFormers) over gathered context.

xFormers has no paged-KV kernel, so each step gathers every request's context from the paged
cache into one concatenated sequence (one index built per step) and runs
``memory_efficient_attention`` with a ``BlockDiagonalCausalFromBottomRightMask``: request ``r``'s
queries (its last ``query_len`` positions) attend causally to its own ``seq_len`` keys only.
Decodes and prefills share the one call (a decode is a block with query length 1). GQA uses
xFormers' 5-D ``[B, M, G, H, K]`` form with K/V expanded (a view, no copy).

Not verified on a GPU: xformers' wheels pin torch versions other than the lent GPU machine's (2.11+cu130),
so ``scripts/gpu_check.sh`` skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata
from plugins.attention._paged_metadata import gather_context_index

_INSTALL = 'pip install xformers (or: pip install -e ".[gpu]")'


@dataclass
class XFormersMetadata:
    """Per-step metadata of :class:`XFormersBackend`."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 where this step's K/V go
    context_index: torch.Tensor  # (sum(seq_lens),) int64 cache slots of every request's context, concatenated
    q_seqlen: list[int]  # per request query length, tokens
    kv_seqlen: list[int]  # per request context + query length, tokens
    attn_bias: Any = None  # xformers BlockDiagonalCausalFromBottomRightMask (None until built on GPU)


def build_xformers_metadata(common: CommonAttentionMetadata) -> XFormersMetadata:
    """Gather index and per-request lengths (device-agnostic, unit-tested on CPU)."""
    return XFormersMetadata(slot_mapping=common.slot_mapping,
                            context_index=gather_context_index(common.block_table, common.seq_lens_cpu,
                                                               common.block_size),
                            q_seqlen=list(common.query_lens_cpu), kv_seqlen=list(common.seq_lens_cpu))


class XFormersBackend(AttentionBackend):
    """Gathered-context attention with ``xformers.ops.memory_efficient_attention``; CUDA, fp16/bf16/fp32.

    No sliding window, softcap or sinks (its bias here is block-diagonal causal only): models that need
    them are refused before loading (``validate_model``), naming a backend that has them.

    Raises:
        ImportError: ``xformers`` is not installed (message gives the pip command).
    """

    name = "xformers"
    requires_cuda = True
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    gpu_check = "not verifiable on the lent GPU machine: xformers' wheels pin other torch versions"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            from xformers import ops as xops
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalFromBottomRightMask
        except ImportError as e:
            raise ImportError(f"attention=xformers needs the xformers package: {_INSTALL}") from e
        self._attend = xops.memory_efficient_attention
        self._mask_cls = BlockDiagonalCausalFromBottomRightMask

    def build_metadata(self, common: CommonAttentionMetadata) -> XFormersMetadata:
        """Gather index plus the block-diagonal bottom-right causal bias of this step."""
        meta = build_xformers_metadata(common)
        meta.attn_bias = self._mask_cls.from_seqlens(q_seqlen=meta.q_seqlen, kv_seqlen=meta.kv_seqlen)
        return meta

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: XFormersMetadata, scale: float | None = None) -> torch.Tensor:
        """Write the step's K/V (all of it, before any read), gather contexts, attend in one call
        (``scale``: this layer's softmax scale when it differs from the backend's)."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        kvh, d = self.num_kv_heads, self.head_size
        group = self.num_heads // kvh
        k = kv_cache[0].view(-1, kvh, d)[metadata.context_index].to(query.dtype)  # (sum_kv, KVH, D)
        v = kv_cache[1].view(-1, kvh, d)[metadata.context_index].to(query.dtype)
        q = query.view(1, -1, kvh, group, d)  # [B=1, M, G=KVH, H=group, D]
        k = k[None, :, :, None, :].expand(1, -1, kvh, group, d)
        v = v[None, :, :, None, :].expand(1, -1, kvh, group, d)
        out = self._attend(q, k, v, attn_bias=metadata.attn_bias, scale=self.scale if scale is None else scale)
        return out.reshape(-1, self.num_heads, d)


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``xformers``."""
    register("xformers", XFormersBackend)
