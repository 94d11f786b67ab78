"""FlashInfer paged attention (Ye et al., "FlashInfer", MLSys 2025) for any block size.

Per step, ``build_metadata`` plans a ``BatchDecodeWithPagedKVCacheWrapper`` (decodes) and a
``BatchPrefillWithPagedKVCacheWrapper`` (prefills and chunks with cached context) once from the
CSR page arrays ``indptr / indices / last_page_len``; every layer then calls ``run``. The
workspace buffer and both wrappers are created once and reused across steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata
from plugins.attention._paged_metadata import PagedKVIndices, paged_kv_indices, split_decode_prefill

_INSTALL = 'pip install flashinfer-python (or: pip install -e ".[gpu]")'
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace


@dataclass
class FlashInferPlan:
    """Kernel-independent part of a step's plan (built on any device, unit-tested on CPU)."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64
    num_decode_tokens: int  # leading decode tokens
    decode: PagedKVIndices | None  # pages of the decode requests
    prefill: PagedKVIndices | None  # pages of the prefill/chunk requests
    prefill_qo_indptr: torch.Tensor | None  # (num_prefills + 1,) int32 query offsets


def build_flashinfer_plan(common: CommonAttentionMetadata) -> FlashInferPlan:
    """CSR page arrays and query offsets for the decode and prefill wrappers."""
    decode, prefill = split_decode_prefill(common)
    return FlashInferPlan(
        slot_mapping=common.slot_mapping, num_decode_tokens=common.num_decode_tokens,
        decode=None if decode is None else paged_kv_indices(decode.block_table, decode.seq_lens, common.block_size),
        prefill=None if prefill is None else paged_kv_indices(prefill.block_table, prefill.seq_lens,
                                                               common.block_size),
        prefill_qo_indptr=None if prefill is None else prefill.query_start_loc.to(torch.int32))


class FlashInferBackend(AttentionBackend):
    """Paged attention with FlashInfer's batch decode/prefill wrappers; CUDA, fp16/bf16, any block size.

    KV cache per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)``; each layer passes
    ``(k_cache, v_cache)`` in FlashInfer's ``NHD`` layout.

    Raises:
        ImportError: ``flashinfer`` is not installed (message gives the pip command).
    """

    name = "flashinfer"
    requires_cuda = True
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = (64, 128, 256)
    supports_cuda_graphs: ClassVar[bool] = False  # plan() per step; capture needs the CUDA-graph wrappers

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(f"attention=flashinfer needs the flashinfer package: {_INSTALL}") from e
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferPlan:
        """Build the page arrays and plan both wrappers once for this step."""
        plan = build_flashinfer_plan(common)
        shape = (self.num_heads, self.num_kv_heads, self.head_size, self.block_size)
        if plan.decode is not None:
            p = plan.decode
            self._decode.plan(p.indptr, p.indices, p.last_page_len, *shape, pos_encoding_mode="NONE",
                              sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        if plan.prefill is not None:
            p = plan.prefill
            self._prefill.plan(plan.prefill_qo_indptr, p.indptr, p.indices, p.last_page_len, *shape, causal=True,
                               sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        return plan

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: FlashInferPlan) -> torch.Tensor:
        """Write the step's K/V (all of it, before any read), then run the planned wrappers."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        cache = (kv_cache[0], kv_cache[1])
        out = torch.empty_like(query)
        nd = metadata.num_decode_tokens
        if metadata.decode is not None:
            out[:nd] = self._decode.run(query[:nd], cache)
        if metadata.prefill is not None:
            out[nd:] = self._prefill.run(query[nd:], cache)
        return out


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``flashinfer``."""
    register("flashinfer", FlashInferBackend)
