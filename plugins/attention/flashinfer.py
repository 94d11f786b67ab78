"""FlashInfer paged attention (Ye et al., "FlashInfer", MLSys 2025) for any block size.

Per step, ``build_metadata`` plans a ``BatchDecodeWithPagedKVCacheWrapper`` (decodes) and a
``BatchPrefillWithPagedKVCacheWrapper`` (prefills and chunks with cached context) once from the
CSR page arrays ``indptr / indices / last_page_len``; every layer then calls ``run``. The
workspace buffer and both wrappers are created once and reused across steps.

Layer features are plan parameters in FlashInfer (``window_left``, ``logits_soft_cap``, ``sm_scale``),
so layers are grouped by ``(window, softcap, scale)``: each group has its own pair of wrappers (sharing
the workspace, as vLLM's), planned at the group's first layer of a step (and again when a layer of
another KV cache group, whose plan has its own pages, used them in between). A window W is
``window_left = W - 1`` (a query sees itself and the W - 1 keys before it, transformers' rule).
Attention sinks are not wired (refused).

Not verified on a GPU: the lent GPU machine has no flashinfer, and ``flashinfer-python``'s wheel alone
(62 MB) nearly fills the 64 MiB a call carries, then JIT-compiles its kernels with nvcc for minutes on
first use, past the 8-minute check; ``scripts/gpu_check.sh`` skips it.
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
    gpu_check = ("not verifiable on the lent GPU machine: its 62 MB wheel fills a call's 64 MiB and it "
                 "JIT-compiles with nvcc for minutes")
    supports_sliding_window = True  # plan(window_left=W - 1)
    supports_softcap = True  # plan(logits_soft_cap=c)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(f"attention=flashinfer needs the flashinfer package: {_INSTALL}") from e
        self._flashinfer = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[tuple, tuple[Any, Any]] = {}  # layer group -> (decode, prefill) wrappers
        # layer group -> the plan its wrappers are planned with now: with KV cache groups a step has one plan
        # per group (its own pages), and layers of two KV cache groups may share a layer group's wrappers
        self._planned_with: dict[tuple, FlashInferPlan] = {}

    def _group(self, scale: float | None, sliding_window: int | None, softcap: float | None) -> tuple:
        return (sliding_window, softcap, self.scale if scale is None else scale)

    def build_metadata(self, common: CommonAttentionMetadata) -> FlashInferPlan:
        """Build the page arrays and plan both wrappers of the plain layer group for this step."""
        plan = build_flashinfer_plan(common)
        self._plan(plan, self._group(None, None, None))
        return plan

    def _plan(self, plan: FlashInferPlan, group: tuple) -> tuple[Any, Any]:
        """Plan a layer group's wrappers with ``plan`` unless they are planned with it already (once per step
        and KV cache group, and again when another group's plan took them in between); returns
        ``(decode, prefill)``."""
        if group not in self._wrappers:
            self._wrappers[group] = (self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD"),
                                     self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD"))
        decode, prefill = self._wrappers[group]
        if self._planned_with.get(group) is plan:
            return decode, prefill
        window, softcap, scale = group
        shape = (self.num_heads, self.num_kv_heads, self.head_size, self.block_size)
        features = {"window_left": window - 1 if window else -1, "logits_soft_cap": softcap, "sm_scale": scale,
                    "q_data_type": self.dtype, "kv_data_type": self.dtype}
        if plan.decode is not None:
            p = plan.decode
            decode.plan(p.indptr, p.indices, p.last_page_len, *shape, pos_encoding_mode="NONE", **features)
        if plan.prefill is not None:
            p = plan.prefill
            prefill.plan(plan.prefill_qo_indptr, p.indptr, p.indices, p.last_page_len, *shape, causal=True, **features)
        self._planned_with[group] = plan
        return decode, prefill

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: FlashInferPlan, scale: float | None = None,
                sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Write the step's K/V (all of it, before any read), then run the layer group's planned wrappers
        (features: see ``AttentionBackend.forward``)."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        decode, prefill = self._plan(metadata, self._group(scale, sliding_window, softcap))
        cache = (kv_cache[0], kv_cache[1])
        out = torch.empty_like(query)
        nd = metadata.num_decode_tokens
        if metadata.decode is not None:
            out[:nd] = decode.run(query[:nd], cache)
        if metadata.prefill is not None:
            out[nd:] = prefill.run(query[nd:], cache)
        return out


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``flashinfer``."""
    register("flashinfer", FlashInferBackend)
