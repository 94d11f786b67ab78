"""Paged attention that reads K/V from the paged cache in place, compiled by inductor.

Every token of the flattened batch (decode rows and prefill chunks alike) attends over the
keys of its request at positions ``0..pos``. The block-table lookup
``slot = block_table[req, j // block_size] * block_size + j % block_size`` (Kwon et al.,
SOSP'23, Sec. 4.1) is written as indexing inside one ``torch.compile``d function whose score and
output are explicit multiply-and-sum reductions; inductor turns the lookup into an indirect load
inside the generated C++ reduction loops, so no per-request copy of the context is materialised
(the ``torch`` reference backend gathers ``[R, S, KVH, D]`` per layer). GQA never repeats K/V:
each KV head's ``G = H / KVH`` query heads are an extra broadcast dimension.

The key slots ``[T, S]`` and the causal bias are built once per step (``build_metadata``) and
shared by all layers. Recompiles are bounded by marking the batch dims dynamic (tokens, key
positions; heads and head size stay static) without duck sizing; the number of graph compilations is counted in :data:`COMPILE_STATS`. Where the compiler is unavailable
(``compile: false``, no C++ toolchain, or a compile error) the same function runs in eager mode,
with a one-time warning; eager materialises the gather and is slower than the ``torch`` backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, CommonAttentionMetadata
from plugins.attention._paged_metadata import split_decode_prefill, write_kv
from plugins.attention.torch import TorchAttentionBackend, TorchAttentionMetadata

logger = logging.getLogger(__name__)

#: Process-wide compile counters: ``graphs`` (inductor compilations) and ``seconds`` (wall time in them).
COMPILE_STATS: dict[str, float] = {"graphs": 0, "seconds": 0.0}


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slots: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal paged attention of each token over its request's cached keys.

    Args:
        query: ``[T, KVH, G, D]`` queries, any float dtype (computed in float32).
        key_cache, value_cache: ``[num_blocks, block_size, KVH, D]`` the layer's paged cache.
        slots: ``[T, S]`` int64 cache slot of key position ``j`` of each token's request
            (``block_table[req, j // block_size] * block_size + j % block_size``; any valid slot
            where ``j`` is past the request's blocks), built once per step for all layers.
        bias: ``[T, S]`` float32, 0 where token ``t`` attends to key ``j`` (``j <= pos(t)``), else
            ``-inf``; every row has at least one 0.
        scale: softmax scale.

    Returns:
        ``[T, KVH, G, D]`` in ``query.dtype``.
    """
    k_flat = key_cache.flatten(0, 1)  # [slots, KVH, D], a view: no copy
    v_flat = value_cache.flatten(0, 1)
    q = query.float() * scale
    k = k_flat[slots].float()  # [T, S, KVH, D]; fused into the reduction below when compiled
    scores = (q[:, None] * k[:, :, :, None, :]).sum(-1) + bias[:, :, None, None]  # [T, S, KVH, G]
    probs = scores.softmax(dim=1)
    v = v_flat[slots].float()
    out = (probs[..., None] * v[:, :, :, None, :]).sum(1)  # [T, KVH, G, D]
    return out.to(query.dtype)


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor, counting compilations and their wall time in :data:`COMPILE_STATS`."""
    from torch._inductor import compile_fx

    start = time.perf_counter()
    # the slots come from the engine's block tables (always in range): no per-load bounds checks
    compiled = compile_fx.compile_fx(gm, example_inputs, config_patches={"assert_indirect_indexing": False})
    COMPILE_STATS["graphs"] += 1
    COMPILE_STATS["seconds"] += time.perf_counter() - start
    return compiled


_COMPILED: dict[str, Any] = {}


def _compiled_kernel() -> Any:
    """The process-wide compiled :func:`paged_attention` (one cache of graphs for all layers)."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(paged_attention, backend=_counting_inductor, fullgraph=True)
    return _COMPILED["fn"]


def _call_compiled(fn: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """Call with the batch dims symbolic: tokens, key positions and the cache's block count.

    Heads, head size and block size stay static (constants in the generated loops). Duck sizing is
    off so that two batch dims that happen to be equal in the first step do not share a symbol
    (which would recompile on the next step); sizes 0/1 still specialise (e.g. batch-1 decode).
    """
    from torch.fx.experimental import _config as fx_config

    query, key_cache, value_cache, slots, bias, _ = args
    for tensor, dims in ((query, (0,)), (key_cache, (0,)), (value_cache, (0,)), (slots, (0, 1)), (bias, (0, 1))):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    with fx_config.patch(use_duck_shape=False):
        return fn(*args)


@dataclass
class PagedAttentionMetadata:
    """Per-step metadata of :class:`TorchPagedAttentionBackend` (built once, shared by all layers)."""

    slots: torch.Tensor  # (num_tokens, S) int64 cache slot of each key position of each token's request
    bias: torch.Tensor  # (num_tokens, S) float32 0 where visible (j <= position), -inf elsewhere


@dataclass
class TorchPagedStepMetadata:
    """Per-step metadata of :class:`TorchPagedAttentionBackend`: which tokens take which path."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slots of the whole step's tokens
    num_paged_tokens: int  # leading tokens attended in place by the compiled kernel (0: none)
    paged: PagedAttentionMetadata | None  # the kernel's metadata of those tokens
    reference: TorchAttentionMetadata | None  # the torch reference's metadata of the remaining tokens


class TorchPagedAttentionBackend(AttentionBackend):
    """Paged attention reading the cache in place through a ``torch.compile``d kernel (CPU/GPU).

    KV cache per layer: ``(2, num_blocks, block_size, num_kv_heads, head_size)`` (the ``torch``
    backend's layout), written by one ``index_copy_`` per layer. The decode rows of a step with at
    least ``min_paged_decodes`` of them go through :func:`paged_attention`; prefill chunks and
    small decode batches go through the ``torch`` reference's gather + SDPA, which is faster there
    (SmolLM2 bf16, 2 cores: batch-64 decode step 88.8 vs 105.8 ms for ``torch``; at batch 1 the
    compiled kernel's per-call cost made the step 38.2 vs 33.4 ms, and a prefill chunk's
    ``[T, S]`` score loops lose to SDPA's GEMMs).

    Args (beyond ``AttentionBackend``'s):
        compile: ``True`` (default) compiles with inductor, at construction (a dummy call); ``False``
            runs eager (slow; for debugging and for machines without a C++ compiler).
        min_paged_decodes: decode rows from which a step's decodes use the in-place kernel
            (default 8; 1 sends every decode through it).
        paged_prefill: also attend prefill chunks (with or without cached context) in place
            (default ``False``; an ablation switch).

    KV-cache quantization (``engine.kv_cache_dtype=int8|fp8_e4m3``) uses the reference's quantized
    layout and runs every step through the reference (the kernel reads unquantized caches only).

    Raises:
        ValueError: ``min_paged_decodes < 1``.
    """

    name = "torch_paged"
    supported_kv_cache_dtypes = TorchAttentionBackend.supported_kv_cache_dtypes  # quantized: all via the reference

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, block_size: int,
                 dtype: torch.dtype, device: torch.device, compile: bool = True, min_paged_decodes: int = 8,
                 paged_prefill: bool = False) -> None:
        super().__init__(num_heads, num_kv_heads, head_size, scale, block_size, dtype, device)
        if int(min_paged_decodes) < 1:
            raise ValueError(f"min_paged_decodes must be >= 1, got {min_paged_decodes}")
        self.compile = bool(compile)
        self.min_paged_decodes = int(min_paged_decodes)
        self.paged_prefill = bool(paged_prefill)
        self.reference = TorchAttentionBackend(num_heads, num_kv_heads, head_size, scale, block_size, dtype, device)
        self.cache_dtype = self.reference.cache_dtype
        self.in_place = self.reference.kv_quant is None  # the kernel reads unquantized caches only
        self._fn = _compiled_kernel() if self.compile else paged_attention
        if self.compile and self.in_place:
            self._warm_up()

    def get_kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The ``torch`` reference's layout (``head_size + 4`` int8 bytes when the cache is quantized)."""
        return self.reference.get_kv_cache_shape(num_blocks)

    def _warm_up(self) -> None:
        """Compile the kernel now (start-up) on a dummy 2-token, 2-block call in this dtype, so that
        the first large decode step of a run does not stall on inductor (seconds to tens of seconds)."""
        group, d, bs = self.num_heads // self.num_kv_heads, self.head_size, self.block_size
        kw = {"device": self.device}
        cache = torch.zeros(2, 2, bs, self.num_kv_heads, d, dtype=self.dtype, **kw)
        meta = PagedAttentionMetadata(torch.arange(2 * bs, **kw).repeat(2, 1), torch.zeros(2, 2 * bs, **kw))
        query = torch.zeros(2, self.num_kv_heads * group, d, dtype=self.dtype, **kw)
        with torch.inference_mode():
            self._attend_in_place(query, cache, meta)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchPagedStepMetadata:
        """Split the step into its in-place part (decodes first) and its reference part."""
        if self.paged_prefill and self.in_place:
            return TorchPagedStepMetadata(common.slot_mapping, common.num_tokens, self._paged_metadata(common), None)
        if common.num_decodes < self.min_paged_decodes or not self.in_place:
            return TorchPagedStepMetadata(common.slot_mapping, 0, None, self.reference.build_metadata(common))
        decode, prefill = split_decode_prefill(common)
        return TorchPagedStepMetadata(common.slot_mapping, common.num_decode_tokens, self._paged_metadata(decode),
                                      None if prefill is None else self.reference.build_metadata(prefill))

    def _paged_metadata(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        """Per-token key slots and causal bias over the longest sequence's blocks, shared by all layers."""
        device = common.seq_lens.device
        q_lens = torch.tensor(common.query_lens_cpu, device=device)
        token_req = torch.repeat_interleave(torch.arange(common.num_reqs, device=device), q_lens)
        starts = common.query_start_loc[:-1].long() - common.query_start_loc[0].long()
        offset = torch.arange(common.num_tokens, device=device) - starts[token_req]
        token_pos = common.context_lens.long()[token_req] + offset
        num_blocks = -(-max(common.seq_lens_cpu) // self.block_size)
        j = torch.arange(num_blocks * self.block_size, device=device)
        table = common.block_table[:, :num_blocks].long()
        slots = table[token_req[:, None], j[None, :] // self.block_size] * self.block_size + j[None, :] % self.block_size
        bias = torch.zeros(slots.shape, dtype=torch.float32, device=device)
        bias.masked_fill_(j[None, :] > token_pos[:, None], float("-inf"))
        return PagedAttentionMetadata(slots, bias)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchPagedStepMetadata) -> torch.Tensor:
        """Write all of the step's K/V, then attend each part; see ``AttentionBackend.forward``."""
        if metadata.paged is None:  # the whole step through the reference (which also quantizes K/V)
            return self.reference.forward(layer_idx, query, key, value, kv_cache, metadata.reference)
        write_kv(kv_cache, key, value, metadata.slot_mapping)
        n = metadata.num_paged_tokens
        paged = self._attend_in_place(query[:n], kv_cache, metadata.paged)
        if metadata.reference is None:
            return paged
        out = torch.empty_like(query)
        out[:n] = paged
        out[n:] = self.reference.attend(query[n:], kv_cache, metadata.reference)
        return out

    def _attend_in_place(self, query: torch.Tensor, kv_cache: torch.Tensor,
                         metadata: PagedAttentionMetadata) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size)
        args = (q, kv_cache[0], kv_cache[1], metadata.slots, metadata.bias, self.scale)
        try:
            out = paged_attention(*args) if self._fn is paged_attention else _call_compiled(self._fn, args)
        except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same math, eager
            if self._fn is paged_attention:
                raise
            logger.warning("torch_paged: torch.compile failed (%s: %s); falling back to eager attention "
                           "(correct but slower than attention=torch)", type(err).__name__, err)
            self._fn = paged_attention
            out = paged_attention(*args)
        return out.reshape(num_tokens, self.num_heads, self.head_size)


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``torch_paged``."""
    register("torch_paged", TorchPagedAttentionBackend)
