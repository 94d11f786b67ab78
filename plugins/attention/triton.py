"""Paged attention with one unified Triton kernel for prefill chunks and decode rows (CUDA, any GPU).

The kernel family of vLLM's ``TRITON_ATTN`` backend (``plugins/attention/_triton_kernel.py``): every
token of the flattened batch attends over its request's keys read in place through the block table,
decodes and prefill chunks in the same launch, GQA without repeating K/V, sliding window, softcap,
sinks, and draft-tree attention for token-tree speculative decoding (each node sees the context, the
accepted tokens and its own ancestors: vLLM's tree-attention bias rule, here a per-request int8
visibility block read inside the kernel instead of vLLM's one ``qq_bias`` shared by the batch). It needs ``triton`` alone (shipped with CUDA builds of torch), so it runs on any CUDA GPU
with nothing extra installed; on CPU tensors the same kernel runs in Triton's interpreter, which is
how the CPU test suite checks it (``TRITON_INTERPRET=1``; far too slow to serve).

``build_metadata`` keeps only device tensors of the runner's metadata (no host values), and the
kernel's grid depends on shapes only, so a decode step can be captured in a CUDA graph
(``supports_cuda_graphs``; ``framework/compilation/cuda_graphs.py``). The step's K/V are written with
the base class's ``write_kv`` (``index_copy_`` into the ``NHD`` pages) before the kernel reads them.

Not done here (vLLM has them): the split-KV ("3-D") decode variant that parallelises one long
context over several programs, so a small decode batch over long contexts under-fills the GPU; FP8
KV caches; ALiBi.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata

_INSTALL = "pip install triton (CUDA builds of torch ship it)"


@dataclass
class TritonAttentionMetadata:
    """Per-step metadata of :class:`TritonAttentionBackend`: the runner's device tensors, unchanged
    (views, no copies), so a captured CUDA graph reads each step's values from the same buffers."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slots of this step's K/V
    block_table: torch.Tensor  # (num_reqs, max_blocks) int32
    seq_lens: torch.Tensor  # (num_reqs,) int32 tokens in KV after this step
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32
    tree_rows: torch.Tensor | None = None  # (num_reqs,) int32 first tree_mask row per request, -1: causal; None: no tree
    tree_mask: torch.Tensor | None = None  # (num_tree_rows, max_tree_q) int8 draft-tree visibility (pack_tree_mask)


class TritonAttentionBackend(AttentionBackend):
    """Unified paged attention in Triton; CUDA, float32/float16/bfloat16, any head size and block size.

    KV cache per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (``NHD`` pages).
    float32 models run the kernel's dot products in IEEE float32 (no TF32), so greedy output can be
    compared with transformers' float32 token for token.

    Verified on CPU only, through Triton's interpreter, against the ``torch`` reference
    (``tests/plugins/attention/test_triton.py``); the compiled kernel on a GPU is checked by
    ``bash scripts/gpu_check.sh`` (``pytest -m gpu``), which no GPU has run yet.

    Raises:
        ImportError: ``triton`` is not installed (message gives the pip command).
    """

    name = "triton"
    requires_cuda = True
    supported_devices: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_cuda_graphs: ClassVar[bool] = True  # device-tensor metadata, shape-only grid
    gpu_check = "scripts/gpu_check.sh (not yet run on a GPU)"
    supports_sliding_window = True  # tiles before the window skipped, the rest masked by position
    supports_softcap = True
    supports_sinks = True  # the running max starts at the sink, the running sum at 1
    supports_tree_attention = True  # per-request ancestor rows masked inside the kernel (pack_tree_mask)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            from plugins.attention._triton_kernel import pack_tree_mask, unified_attention
        except ImportError as e:
            raise ImportError(f"attention=triton needs the triton package: {_INSTALL}") from e
        self._attend = unified_attention
        self._pack_tree = pack_tree_mask

    def build_metadata(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        """The runner's device tensors (decodes and prefill chunks together: one kernel launch per layer); a verify
        step's draft trees (``common.spec_tree``) packed once for every layer (one host-to-device copy; such
        steps run eagerly, never in a CUDA graph)."""
        tree_rows = tree_mask = None
        if common.spec_tree is not None:
            tree = common.spec_tree
            tree_rows, tree_mask = self._pack_tree(common.num_reqs, tree.requests, tree.visible,
                                                   common.seq_lens.device)
        return TritonAttentionMetadata(slot_mapping=common.slot_mapping, block_table=common.block_table,
                                       seq_lens=common.seq_lens, query_start_loc=common.query_start_loc,
                                       tree_rows=tree_rows, tree_mask=tree_mask)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TritonAttentionMetadata, scale: float | None = None,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write the step's K/V at ``slot_mapping`` (all of it, before any read), then one kernel launch
        for every token (features: see ``AttentionBackend.forward``)."""
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty_like(query)
        return self._attend(out, query, kv_cache[0], kv_cache[1], metadata.block_table, metadata.seq_lens,
                            metadata.query_start_loc, self.scale if scale is None else scale,
                            sliding_window=sliding_window, softcap=softcap, sinks=sinks,
                            tree_rows=metadata.tree_rows, tree_mask=metadata.tree_mask)


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``triton``."""
    register("triton", TritonAttentionBackend)
