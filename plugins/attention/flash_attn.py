"""FlashAttention-2 paged attention (Dao, "FlashAttention-2", 2023) through the ``flash-attn`` package.

Prefill and chunks with cached context run ``flash_attn_varlen_func`` over the paged cache
(``block_table`` argument, ``cu_seqlens_q`` / ``cu_seqlens_k``); decodes run
``flash_attn_with_kvcache`` with ``cache_seqlens`` and ``block_table``. GQA is native (no K/V repeat).

Layer features: a sliding window W is flash-attn's ``window_size=(W - 1, 0)`` (a query at position
p sees keys p - W + 1 .. p, transformers' rule) and a softcap is its ``softcap`` argument, in both
kernels (flash-attn >= 2.6). Attention sinks are not in flash-attn 2: a model with them is refused.

Block size: upstream flash-attn's paged KV requires the page size (our ``block_size``) to be a
multiple of 256 (``flash_attn_interface.py``: "page_block_size must be a multiple of 256"); this
backend declares ``block_size_multiple = 256`` and is refused before the model loads otherwise.
Use ``engine.block_size=256`` with it.

Not verified on a GPU: the lent GPU machine (torch 2.11+cu130, no network) has no flash-attn, and no
published wheel matches that torch (a source build takes hours), so ``scripts/gpu_check.sh`` skips it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata
from plugins.attention._paged_metadata import cu_seqlens, split_decode_prefill

_INSTALL = 'pip install flash-attn --no-build-isolation (or: pip install -e ".[gpu]")'


@dataclass
class FlashAttnMetadata:
    """Per-step metadata of :class:`FlashAttnBackend` (all tensors on the GPU)."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64
    num_decode_tokens: int  # leading decode tokens (query length 1)
    decode_seq_lens: torch.Tensor | None  # (num_decodes,) int32 ``cache_seqlens``
    decode_block_table: torch.Tensor | None  # (num_decodes, max_blocks) int32
    cu_seqlens_q: torch.Tensor | None  # (num_prefills + 1,) int32, prefill queries
    cu_seqlens_k: torch.Tensor | None  # (num_prefills + 1,) int32, prefill context + query
    max_seqlen_q: int  # longest prefill query, tokens
    max_seqlen_k: int  # longest prefill sequence, tokens
    prefill_block_table: torch.Tensor | None  # (num_prefills, max_blocks) int32


def build_flash_attn_metadata(common: CommonAttentionMetadata) -> FlashAttnMetadata:
    """Index arrays for both kernels from the runner's metadata (device-agnostic, unit-tested on CPU)."""
    decode, prefill = split_decode_prefill(common)
    return FlashAttnMetadata(
        slot_mapping=common.slot_mapping, num_decode_tokens=common.num_decode_tokens,
        decode_seq_lens=None if decode is None else decode.seq_lens.to(torch.int32),
        decode_block_table=None if decode is None else decode.block_table.to(torch.int32),
        cu_seqlens_q=None if prefill is None else prefill.query_start_loc.to(torch.int32),
        cu_seqlens_k=None if prefill is None else cu_seqlens(prefill.seq_lens),
        max_seqlen_q=0 if prefill is None else prefill.max_query_len,
        max_seqlen_k=0 if prefill is None else prefill.max_seq_len,
        prefill_block_table=None if prefill is None else prefill.block_table.to(torch.int32))


def flash_attn_feature_args(scale: float, sliding_window: int | None, softcap: float | None) -> dict[str, Any]:
    """flash-attn keyword arguments of a layer: ``softmax_scale``, ``window_size`` (``(W - 1, 0)``: a query
    sees itself and the W - 1 keys before it; ``(-1, -1)``: no window) and ``softcap`` (0: none)."""
    return {"softmax_scale": scale, "window_size": (sliding_window - 1, 0) if sliding_window else (-1, -1),
            "softcap": softcap or 0.0}


class FlashAttnBackend(AttentionBackend):
    """Paged attention with flash-attn 2 kernels; CUDA, fp16/bf16, head sizes up to 256.

    KV cache per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (NHD pages, the
    layout ``flash_attn_with_kvcache`` reads as ``k_cache``/``v_cache``).

    Raises:
        ImportError: ``flash-attn`` is not installed (message gives the pip command).
    """

    name = "flash_attn"
    requires_cuda = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = tuple(range(8, 257, 8))
    block_size_multiple: ClassVar[int] = 256
    supports_cuda_graphs: ClassVar[bool] = True
    gpu_check = "not verifiable on the lent GPU machine: no flash-attn wheel matches its torch 2.11+cu130"
    supports_sliding_window = True  # window_size=(W - 1, 0)
    supports_softcap = True  # softcap=c

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as e:
            raise ImportError(f"attention=flash_attn needs the flash-attn package: {_INSTALL}") from e
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashAttnMetadata:
        """See :func:`build_flash_attn_metadata`."""
        return build_flash_attn_metadata(common)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: FlashAttnMetadata, scale: float | None = None,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Write the step's K/V at ``slot_mapping`` (all of it, before any read), then run the
        decode kernel on the leading decode tokens and the varlen kernel on the rest (features: see
        ``AttentionBackend.forward``)."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(query)
        nd = metadata.num_decode_tokens
        kernel_args = flash_attn_feature_args(self.scale if scale is None else scale, sliding_window, softcap)
        if metadata.decode_seq_lens is not None:
            o = self._with_kvcache(query[:nd].unsqueeze(1), k_cache, v_cache, cache_seqlens=metadata.decode_seq_lens,
                                   block_table=metadata.decode_block_table, causal=True, **kernel_args)
            out[:nd] = o.squeeze(1)
        if metadata.cu_seqlens_q is not None:
            out[nd:] = self._varlen(query[nd:], k_cache, v_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                                    metadata.max_seqlen_q, metadata.max_seqlen_k, causal=True,
                                    block_table=metadata.prefill_block_table, **kernel_args)
        return out


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``flash_attn``."""
    register("flash_attn", FlashAttnBackend)
