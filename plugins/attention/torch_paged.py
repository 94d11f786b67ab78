"""Paged attention that reads K/V from the paged cache in place, compiled by inductor.

Every token of the flattened batch (decode rows and prefill chunks alike) attends over the
keys of its request at positions ``0..pos`` through :func:`~plugins.attention._paged_kernel.paged_attention`:
the block-table lookup (Kwon et al., SOSP'23, Sec. 4.1) is indexing inside plain torch code that
inductor turns into indirect loads in its generated C++ loops, so no per-request copy of the context
is materialised (the ``torch`` reference backend gathers ``[R, S, KVH, D]`` per layer). Keys are
stored with each block's positions innermost (``_paged_kernel``'s layout), so the score loop is
vectorised over a block's keys. GQA never repeats K/V.

Two ways in:

- ``forward`` (eager engines, and steps a compiled decoder cannot take whole): the kernel is
  compiled once per process for all layers, called per layer. Recompiles are bounded by marking the
  batch dims dynamic (tokens, KV partitions, partitions per token; heads and head size stay static) without duck sizing;
  the number of graph compilations is counted in :data:`COMPILE_STATS`. Where the compiler is
  unavailable (``compile: false``, no C++ toolchain, or a compile error) the same function runs in
  eager mode, with a one-time warning; eager materialises the gather and is slower than ``torch``.
- ``traceable_forward`` (``engine.compile=true``, steps whose tokens are all decodes): the K/V
  write (``write_kv_in_graph``, performed in place by inductor) and the kernel are traced into the
  compiled decoder graph, so a decode step makes no per-layer Python call, dynamo guard check or
  opaque-op dispatch for attention.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from framework import hookimpl
from framework.compilation import vec_isa
from framework.compilation.decoder import inductor_config
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata
from plugins.attention._kv_quant import QMAX
from plugins.attention._paged_kernel import KVPartitions, kv_partitions, paged_attention, write_kv_in_graph
from plugins.attention._paged_metadata import split_decode_prefill
from plugins.attention.torch import TorchAttentionBackend, TorchAttentionMetadata

logger = logging.getLogger(__name__)

#: Process-wide compile counters: ``graphs`` (inductor compilations) and ``seconds`` (wall time in them).
COMPILE_STATS: dict[str, float] = {"graphs": 0, "seconds": 0.0}


def _counting_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor, counting compilations and their wall time in :data:`COMPILE_STATS`."""
    from torch._inductor import compile_fx

    vec_isa.install()  # inductor's per-process ISA probes, answered from this machine's record
    start = time.perf_counter()
    # the slots come from the engine's block tables (always in range): no per-load bounds checks; FMAs for bf16/fp16
    compiled = compile_fx.compile_fx(gm, example_inputs, config_patches=inductor_config(example_inputs))
    COMPILE_STATS["graphs"] += 1
    COMPILE_STATS["seconds"] += time.perf_counter() - start
    return compiled


_COMPILED: dict[str, Any] = {}


def _compiled_kernel() -> Any:
    """The process-wide compiled :func:`paged_attention` (one cache of graphs for all layers)."""
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(paged_attention, backend=_counting_inductor, fullgraph=True)
    return _COMPILED["fn"]


def _mark_dynamic(kv: KVPartitions) -> None:
    """Mark the batch dims of ``kv`` dynamic: partitions, tokens and partitions per token."""
    for tensor, dims in ((kv.block_tables, (0,)), (kv.kv_lens, (0,)), (kv.tokens, (0,)), (kv.partitions, (0, 1)),
                         (kv.num_partitions, (0,)), (kv.kv_starts, (0,))):
        for dim in dims if tensor is not None else ():
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _call_compiled(fn: Any, args: tuple[Any, ...]) -> torch.Tensor:
    """Call with the batch dims symbolic: tokens, partitions, partitions per token and the cache's blocks.

    Heads, head size, block size and blocks per partition stay static (constants in the generated
    loops). Duck sizing is off so that two batch dims that happen to be equal in the first step do
    not share a symbol (which would recompile on the next step); sizes 0/1 still specialise (e.g.
    batch-1 decode), so ``kv_partitions`` makes at least ``MIN_PARTITIONS`` of each.
    """
    from torch.fx.experimental import _config as fx_config

    query, kv_cache, kv = args[:3]
    torch._dynamo.maybe_mark_dynamic(query, 0)
    torch._dynamo.maybe_mark_dynamic(kv_cache, 1)
    _mark_dynamic(kv)
    with fx_config.patch(use_duck_shape=False):
        return fn(*args)


@dataclass
class PagedAttentionMetadata:
    """Inputs of :func:`paged_attention` for a run of tokens (built once per step, shared by all layers)."""

    kv: KVPartitions  # the keys each token attends to (its position + 1), cut into partitions
    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slots of these tokens' new K/V
    windows: dict[int, KVPartitions] = field(default_factory=dict)  # sliding window W -> the last W of those keys

    def partitions(self, window: int | None) -> KVPartitions:
        """The partitions of a layer with this sliding window (``None``: full causal).

        Raises:
            RuntimeError: the backend was built without a layer of this window (``layers``).
        """
        if window is None:
            return self.kv
        if window not in self.windows:
            raise RuntimeError(f"torch_paged: no metadata for sliding window {window}; the backend's layers "
                               f"declare windows {sorted(self.windows)}")
        return self.windows[window]


@dataclass
class TorchPagedStepMetadata:
    """Per-step metadata of :class:`TorchPagedAttentionBackend`: which tokens take which path."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64 cache slots of the whole step's tokens
    num_paged_tokens: int  # leading tokens attended in place by the compiled kernel (0: none)
    paged: PagedAttentionMetadata | None  # the kernel's metadata of those tokens
    reference: TorchAttentionMetadata | None  # the torch reference's metadata of the remaining tokens
    graph: PagedAttentionMetadata | None = None  # every token in place (all decodes): traceable_forward's input


class TorchPagedAttentionBackend(AttentionBackend):
    """Paged attention reading the cache in place through a ``torch.compile``d kernel (CPU/GPU).

    KV cache per layer: ``(2, num_blocks, num_kv_heads, block_size * head_size)`` elements, each
    block stored head-major (``kv_cache_layout = "HDN"``, see ``plugins/attention/_paged_kernel.py``):
    keys as ``[num_kv_heads, head_size, block_size]``, values as ``[num_kv_heads, block_size, head_size]``.

    Eager engines (``forward``): the decode rows of a step with at least ``min_paged_decodes`` of
    them go through the compiled kernel; prefill chunks and small decode batches go through the
    ``torch`` reference's gather + SDPA (reading this layout), which is faster there: at batch 1 the
    kernel's per-call cost (dynamo guards, Python) exceeds the attention itself, and a prefill
    chunk's ``[T, S]`` score loops lose to SDPA's GEMMs.

    Compiled engines (``engine.compile=true``): a step whose tokens are all decodes, of any batch
    size, is attended inside the compiled decoder graph (:meth:`traceable_inputs`,
    :meth:`traceable_forward`); other steps take ``forward`` through the opaque attention op.

    Args (beyond ``AttentionBackend``'s):
        compile: ``True`` (default) compiles the per-layer kernel with inductor, at construction (a
            dummy call); ``False`` runs it eagerly (slow; for debugging and machines without a C++
            compiler).
        min_paged_decodes: decode rows from which an eager step's decodes use the in-place kernel
            (default 8; 1 sends every decode through it).
        paged_prefill: also attend prefill chunks (with or without cached context) in place
            (default ``False``; an ablation switch).
        prefill_kernel: the reference's SDPA layout for the prefill chunks it attends, ``packed``
            (default) or ``gqa`` (see ``TorchAttentionBackend``).
        prefill_tile: query tokens per causal tile of those chunks (default 64; 0: whole chunks; see
            ``TorchAttentionBackend``).

    KV-cache quantization (``engine.kv_cache_dtype=int8|fp8_e4m3``) uses the reference's quantized
    layout and runs every step through the reference (the kernel reads unquantized caches only); so does
    MLA's latent cache (``AttentionLayerSpec.latent_kv``: the reference's NHD layout, V read as K).

    Raises:
        ValueError: ``min_paged_decodes < 1``.
    """

    name = "torch_paged"
    supported_kv_cache_dtypes = TorchAttentionBackend.supported_kv_cache_dtypes  # quantized: all via the reference
    supports_sliding_window = True  # partitions from the window's first block; the reference masks
    supports_softcap = True
    supports_sinks = True
    supports_tree_attention = True  # a verify step's query chunks always go through the reference's masks
    supports_latent_kv = True  # MLA's latent cache: every step through the reference (NHD, V read as K)

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, block_size: int,
                 dtype: torch.dtype, device: torch.device, layers: Sequence[AttentionLayerSpec] | None = None,
                 compile: bool = True, min_paged_decodes: int = 8, paged_prefill: bool = False,
                 prefill_kernel: str = "packed", prefill_tile: int = 64) -> None:
        super().__init__(num_heads, num_kv_heads, head_size, scale, block_size, dtype, device, layers)
        if int(min_paged_decodes) < 1:
            raise ValueError(f"min_paged_decodes must be >= 1, got {min_paged_decodes}")
        self.compile = bool(compile)
        self.min_paged_decodes = int(min_paged_decodes)
        self.paged_prefill = bool(paged_prefill)
        self.in_place = dtype not in QMAX and not self.latent_kv  # the kernel reads unquantized (K, V) caches only
        self.reference = TorchAttentionBackend(num_heads, num_kv_heads, head_size, scale, block_size, dtype, device,
                                               layers, prefill_kernel=prefill_kernel, prefill_tile=prefill_tile,
                                               kv_layout="HDN" if self.in_place else "NHD")
        self.cache_dtype = self.reference.cache_dtype
        self.kv_cache_layout = self.reference.kv_cache_layout  # "HDN" ("NHD" when quantized)
        self._fn = _compiled_kernel() if self.compile else paged_attention
        if self.compile and self.in_place:
            self._warm_up()

    def get_kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """``(2, num_blocks, kv_heads, block_size * head_size)`` (quantized: the reference's NHD
        ``(2, num_blocks, block_size, kv_heads, head_size + 4)`` int8)."""
        return self.reference.get_kv_cache_shape(num_blocks)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store K/V at ``slot_mapping`` in this backend's layout (the reference's, configured for it);
        see ``AttentionBackend.write_kv``."""
        self.reference.write_kv(kv_cache, key, value, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V stored at ``slots``; see ``AttentionBackend.read_kv``."""
        return self.reference.read_kv(kv_cache, slots)

    def _warm_up(self) -> None:
        """Compile the kernel now (start-up) on a dummy 2-token, 2-block call in this dtype, once per
        distinct layer kind (window or not, softcap, sinks), so that the first large decode step of a
        run does not stall on inductor (seconds to tens of seconds)."""
        group, d, bs = self.num_heads // self.num_kv_heads, self.head_size, self.block_size
        kw = {"device": self.device}
        kinds = {(layer.sliding_window, layer.softcap, layer.has_sinks) for layer in self.layers} or {(None, None, False)}
        # as in the engine: the cache is allocated outside inference mode, the step's tensors inside
        # (dynamo guards on their dispatch keys: any difference recompiles at the first real step)
        cache = torch.zeros(self.get_kv_cache_shape(3), dtype=self.dtype, **kw)
        with torch.inference_mode():
            table, lens = torch.tensor([[0, 1], [1, 2]], **kw), [bs + 1, 2 * bs]
            windows = {w: kv_partitions(table, lens, bs, window=w) for w, _, _ in kinds if w is not None}
            meta = PagedAttentionMetadata(kv_partitions(table, lens, bs), torch.tensor([bs, 2 * bs + 1], **kw), windows)
            query = torch.zeros(2, self.num_kv_heads * group, d, dtype=self.dtype, **kw)
            for window, softcap, sinks in sorted(kinds, key=str):
                features = {"sliding_window": window, "softcap": softcap,
                            "sinks": torch.zeros(self.num_heads, dtype=self.dtype, **kw) if sinks else None}
                self._attend_in_place(query, cache, meta, **features)

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchPagedStepMetadata:
        """Split the step into its in-place part (decodes first) and its reference part; when every
        token is a decode, also the whole-step metadata of :meth:`traceable_forward`."""
        all_decodes = common.num_decodes == common.num_reqs == common.num_tokens
        graph = self._paged_metadata(common) if self.in_place and all_decodes else None
        if self.paged_prefill and self.in_place and common.spec_tree is None:  # draft trees: the reference's masks
            return TorchPagedStepMetadata(common.slot_mapping, common.num_tokens,
                                          graph or self._paged_metadata(common), None, graph)
        if common.num_decodes < self.min_paged_decodes or not self.in_place:
            return TorchPagedStepMetadata(common.slot_mapping, 0, None, self.reference.build_metadata(common), graph)
        if graph is not None:
            return TorchPagedStepMetadata(common.slot_mapping, common.num_tokens, graph, None, graph)
        decode, prefill = split_decode_prefill(common)
        return TorchPagedStepMetadata(common.slot_mapping, common.num_decode_tokens, self._paged_metadata(decode),
                                      None if prefill is None else self.reference.build_metadata(prefill))

    def _paged_metadata(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        """Each token's visible keys (position + 1) cut into partitions, shared by all layers, and the
        same for each sliding window the layers use."""
        if common.num_tokens == common.num_reqs:  # one token per request (decodes)
            kv_lens, rows = common.seq_lens_cpu, None
        else:
            q_lens, seq_lens = np.asarray(common.query_lens_cpu), np.asarray(common.seq_lens_cpu)
            rows = np.repeat(np.arange(common.num_reqs), q_lens)
            offset = np.arange(common.num_tokens) - (np.cumsum(q_lens) - q_lens)[rows]
            kv_lens = (seq_lens - q_lens)[rows] + offset + 1
        windows = {w: kv_partitions(common.block_table, kv_lens, self.block_size, rows, window=w)
                   for w in self.sliding_windows}
        return PagedAttentionMetadata(kv_partitions(common.block_table, kv_lens, self.block_size, rows),
                                      common.slot_mapping, windows)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TorchPagedStepMetadata, **features: Any) -> torch.Tensor:
        """Write all of the step's K/V, then attend each part; see ``AttentionBackend.forward``."""
        if metadata.paged is None and not self.in_place:  # quantized: the reference writes and attends
            return self.reference.forward(layer_idx, query, key, value, kv_cache, metadata.reference, **features)
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        if metadata.paged is None:
            return self.reference.attend(query, kv_cache, metadata.reference, **features)
        n = metadata.num_paged_tokens
        paged = self._attend_in_place(query[:n], kv_cache, metadata.paged, **features)
        if metadata.reference is None:
            return paged
        out = torch.empty_like(query)
        out[:n] = paged
        out[n:] = self.reference.attend(query[n:], kv_cache, metadata.reference, **features)
        return out

    def traceable_inputs(self, metadata: TorchPagedStepMetadata) -> PagedAttentionMetadata | None:
        """The whole-step kernel inputs when every token is a decode (else ``None``), batch dims
        marked dynamic; see ``AttentionBackend.traceable_inputs``."""
        graph = metadata.graph
        if graph is not None:
            for kv in (graph.kv, *graph.windows.values()):
                _mark_dynamic(kv)
            torch._dynamo.maybe_mark_dynamic(graph.slot_mapping, 0)
        return graph

    def traceable_forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, inputs: PagedAttentionMetadata, scale: float | None = None,
                          sliding_window: int | None = None, softcap: float | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write K/V (``write_kv_in_graph``) and attend in place, as traceable torch code;
        see ``AttentionBackend.traceable_forward``."""
        write_kv_in_graph(kv_cache, key, value, inputs.slot_mapping)
        num_tokens = query.shape[0]
        q = query.reshape(num_tokens, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size)
        out = paged_attention(q, kv_cache, inputs.partitions(sliding_window), self.scale if scale is None else scale,
                              softcap, sinks)
        return out.reshape(num_tokens, self.num_heads, self.head_size)

    def _attend_in_place(self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: PagedAttentionMetadata,
                         scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = query.shape[0]
        q = query.reshape(num_tokens, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size)
        # a view of the cache: _call_compiled marks its block dim dynamic, and a marking on the cache
        # tensor itself would fail the guards of a compiled decoder graph that takes it as an input
        args = (q, kv_cache.view(kv_cache.shape), metadata.partitions(sliding_window),
                self.scale if scale is None else scale, softcap, sinks)
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
