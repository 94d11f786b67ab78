"""Attention backend: KV-cache layout, per-step metadata, and the paged attention kernel.

The trio follows vLLM V1: the backend class states shapes and capabilities, ``build_metadata``
turns the runner's :class:`CommonAttentionMetadata` into whatever its kernel wants (once per
step), and ``forward`` runs once per layer.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    from framework.config import EngineConfig


@dataclass
class SpecTreeMask:
    """Tree attention of a verify step's draft trees (speculative decoding with token trees,
    ``framework/core/spec_tree.py``): which of its own query tokens each query token of a tree request sees.

    The query tokens of a tree request sit at consecutive KV positions (its real tokens, then the tree's nodes
    parents first); key ``m`` of the request's query chunk (at position ``context_len + m``) is visible to query
    token ``j`` iff ``visible[i][j, m]``; context keys (positions ``< context_len``) stay visible to every query.
    Requests without a tree attend causally, as always. Built by ``prepare_inputs``; honoured by backends with
    ``supports_tree_attention``.
    """

    requests: list[int]  # batch indices of the requests that verify a tree this step
    visible: list[torch.Tensor]  # per such request: (query_len, query_len) bool, CPU (ancestors and itself)

    def shifted(self, first: int) -> SpecTreeMask | None:
        """The same trees with batch indices counted from request ``first`` (requests before it dropped);
        ``None`` when no tree request is left."""
        kept = [(r - first, v) for r, v in zip(self.requests, self.visible, strict=True) if r >= first]
        return SpecTreeMask([r for r, _ in kept], [v for _, v in kept]) if kept else None


@dataclass
class CommonAttentionMetadata:
    """Backend-independent description of one flattened batch, built once per step.

    Requests are ordered decodes first (query length 1), then prefills/chunks. Token ``t`` of the
    flattened batch belongs to request ``r`` when ``query_start_loc[r] <= t < query_start_loc[r+1]``.
    Tensors live on the model's device unless marked CPU.
    """

    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32, cumulative query lengths
    seq_lens: torch.Tensor  # (num_reqs,) int32, tokens in KV after this step (context + query)
    context_lens: torch.Tensor  # (num_reqs,) int32, tokens already in KV before this step
    block_table: torch.Tensor  # (num_reqs, max_num_blocks_per_req) int32, padded with 0
    slot_mapping: torch.Tensor  # (num_tokens,) int64, cache slot = block_id * block_size + offset
    query_lens_cpu: list[int]  # (num_reqs,) query lengths, CPU
    seq_lens_cpu: list[int]  # (num_reqs,) seq lengths, CPU
    num_reqs: int
    num_tokens: int  # tokens in the flattened batch
    num_decodes: int  # leading requests with query length 1
    num_decode_tokens: int  # == num_decodes without spec decode
    max_query_len: int
    max_seq_len: int
    block_size: int
    spec_tree: SpecTreeMask | None = None  # tree attention of draft trees verified this step (None: causal)


@dataclass(frozen=True)
class AttentionLayerSpec:
    """What one decoder layer's attention computes, read from the model's ``config.json`` before its
    weights load (``framework.model_executor.model_families.attention_layers``).

    The capability check (:meth:`AttentionBackend.validate_model`) and the backend instance share it;
    the bridge (``framework/model_executor/forward_context.py``) checks every call transformers makes against it.
    The softmax scale is not part of it: transformers passes it with every call (``scaling``).
    """

    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (== num_heads without GQA and for MLA's expanded K/V; 1 for MLA's latent)
    head_size: int  # query/key channels per head
    value_head_size: int  # value channels per head (!= head_size for MLA: DeepSeek-V2/V3)
    sliding_window: int | None = None  # W: a query at position p sees keys at positions > p - W (W keys incl. itself)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), after scaling, before the mask
    has_sinks: bool = False  # a learned per-head logit joins the softmax denominator only (gpt-oss ``s_aux``)
    # MLA latent KV cache (DeepSeek-V2 §2.1, ``engine.mla_latent_cache``): the cache holds one K "head" per token,
    # [c_kv (value_head_size = kv_lora_rank), k_rope] (head_size wide), and V is its first value_head_size channels
    # (no V tensor: the cache's leading dim is 1); queries arrive already absorbed (framework/model_executor/mla.py)
    latent_kv: bool = False

    @property
    def cache_head_size(self) -> int:
        """Channels per head of the KV cache: ``max(head_size, value_head_size)`` (the smaller of K and V
        is zero-padded by the bridge, so both fit one ``(2, ...)`` cache tensor)."""
        return max(self.head_size, self.value_head_size)


#: Optional attention features a layer may need, passed with each call -> the backend capability attribute that runs it.
LAYER_FEATURES: dict[str, str] = {"sliding_window": "supports_sliding_window", "softcap": "supports_softcap",
                                  "has_sinks": "supports_sinks"}
#: Layer features that change the KV cache's layout instead of the call -> the backend capability attribute.
CACHE_FEATURES: dict[str, str] = {"latent_kv": "supports_latent_kv"}
#: Every layer feature -> its capability attribute (what validate_model and ``servelab models`` check).
CAPABILITY_OF: dict[str, str] = {**LAYER_FEATURES, **CACHE_FEATURES}
#: How problems name each feature.
FEATURE_NAMES: dict[str, str] = {"sliding_window": "sliding-window attention", "softcap": "attention-logit softcapping",
                                 "has_sinks": "attention sinks (s_aux)",
                 "latent_kv": "MLA latent KV cache (engine.mla_latent_cache=false expands K/V per head instead)"}


def required_features(layers: Sequence[AttentionLayerSpec]) -> dict[str, str]:
    """Features of :data:`CAPABILITY_OF` some layer needs -> a description naming the layers.

    Example: ``{"sliding_window": "sliding-window attention (window 7 on layers [0, 1, 3])"}``.
    """
    needs = {}
    for feature, label in FEATURE_NAMES.items():
        using = [i for i, layer in enumerate(layers) if getattr(layer, feature)]
        if using:
            values = sorted({getattr(layers[i], feature) for i in using} - {True})
            detail = f"{feature.removeprefix('has_').replace('_', ' ')} {', '.join(map(str, values))} " if values else ""
            needs[feature] = f"{label} ({detail}on layers {using})"
    return needs


def latent_kv_problems(layers: Sequence[AttentionLayerSpec], config: EngineConfig | None) -> list[str]:
    """What the MLA latent cache (``engine.mla_latent_cache=true``) is not built to combine with, for a model
    whose ``layers`` cache the latent: a quantized KV cache, weight quantization (the absorbed ``kv_b_proj``
    is read as a float matrix) and LoRA (tensor parallelism is: each rank absorbs its heads' slice of
    ``kv_b_proj`` and caches the whole latent). Empty when no layer is latent or ``config`` is ``None``; each
    problem names the fix."""
    if config is None or not any(layer.latent_kv for layer in layers):
        return []
    fix = ", or engine.mla_latent_cache=false to expand K/V per head"
    checks = [(config.kv_cache_dtype == "auto", f"kv_cache_dtype={config.kv_cache_dtype} (set kv_cache_dtype=auto"),
              (config.quant in (None, "none"), f"quant={config.quant} (set quant=none"),
              (not getattr(config, "enable_lora", False), "LoRA adapters (set lora.enable=false")]
    return [f"the MLA latent KV cache is not built with {what}{fix})" for ok, what in checks if not ok]


class AttentionBackend(Plugin, ABC):
    """Paged attention over a flattened batch mixing prefill chunks and decodes.

    Args:
        num_heads: query heads per layer.
        num_kv_heads: key/value heads (GQA when smaller than num_heads).
        head_size: channels per head.
        scale: softmax scale, usually ``head_size ** -0.5``.
        block_size: tokens per KV block.
        dtype: KV-cache element dtype: the model dtype, or ``torch.int8``/``torch.float8_e4m3fn`` when
            ``engine.kv_cache_dtype`` quantizes the cache (only if listed in ``supported_kv_cache_dtypes``).
        device: torch device of the cache and inputs.
        layers: one :class:`AttentionLayerSpec` per decoder layer (window, softcap, sinks), so metadata
            can be built per step for every window the model uses; empty (the default) means plain
            causal attention on every layer. ``head_size`` is the layers' ``cache_head_size``.

    ``cache_dtype`` is the storage dtype the runner allocates the cache tensors with (``dtype`` unless
    the backend packs quantized K/V and their scales into bytes). Every KV tensor of a backend is
    indexed by block id on dim 1 of :meth:`get_kv_cache_shape`, so copying a block (swap, migration)
    copies its data and its scales together.

    Raises:
        ImportError: from ``__init__`` when the backend's kernel library is missing (with the
            pip command that installs it).
    """

    # Capabilities, checked before the model loads (validate / validate_model):
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")  # torch device types
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any head size
    block_size_multiple: ClassVar[int] = 1  # block_size must be a multiple of this (kernel page-size rule)
    kv_cache_layout: ClassVar[str] = "NHD"  # per layer (2, num_blocks, block_size, kv_heads, head_size)
    # an all-decode step may be captured in a CUDA graph: build_metadata keeps only views of the runner's device
    # tensors and its kernels' launch shapes depend on tensor shapes only (framework/compilation/cuda_graphs.py)
    supports_cuda_graphs: ClassVar[bool] = False
    supported_kv_cache_dtypes: ClassVar[tuple[str, ...]] = ("auto",)  # engine.kv_cache_dtype values
    # a GPU kernel: how scripts/gpu_check.sh verifies it, or why the lent GPU machine cannot (servelab plugins)
    gpu_check: ClassVar[str] = ""
    # Layer features (AttentionLayerSpec), per call in forward's keyword arguments; validate_model refuses
    # a model needing one its backend lacks:
    supports_sliding_window: ClassVar[bool] = False  # forward(..., sliding_window=W)
    supports_softcap: ClassVar[bool] = False  # forward(..., softcap=c)
    supports_sinks: ClassVar[bool] = False  # forward(..., sinks=(num_heads,) tensor)
    # draft-tree verification (token-tree speculative decoding): the backend honours
    # CommonAttentionMetadata.spec_tree; a drafter proposing trees is refused with any other backend
    supports_tree_attention: ClassVar[bool] = False
    # MLA's latent cache (AttentionLayerSpec.latent_kv): get_kv_cache_shape's leading dim is 1 (K only) and V is
    # read as the first value_head_size channels of K (the bridge cuts the output to them)
    supports_latent_kv: ClassVar[bool] = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 layers: Sequence[AttentionLayerSpec] | None = None, **params: Any) -> None:
        if params:
            raise TypeError(f"attention backend {self.name!r} got unknown parameters {sorted(params)}")
        self.layers: tuple[AttentionLayerSpec, ...] = tuple(layers or ())
        #: per layer, what its attention calls carry: (num_heads, num_kv_heads, cache_head_size,
        #: sliding_window, softcap, has_sinks); the bridge compares each call with it
        self.call_signatures: tuple[tuple, ...] = tuple(
            (layer.num_heads, layer.num_kv_heads, layer.cache_head_size, layer.sliding_window, layer.softcap,
             layer.has_sinks) for layer in self.layers)
        #: every window some layer uses, ascending (per-step metadata is built for each)
        self.sliding_windows: tuple[int, ...] = tuple(sorted({w for layer in self.layers
                                                              if (w := layer.sliding_window)}))
        #: every layer caches MLA's latent (K only, V = K's first channels): the cache tensors' leading dim is 1
        self.latent_kv: bool = bool(self.layers) and all(layer.latent_kv for layer in self.layers)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.block_size = block_size
        self.dtype = dtype
        self.cache_dtype = dtype
        self.device = device

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Capability check (device, dtype) before the model loads; see ``Plugin.validate``.

        ``build_engine`` resolves ``dtype="auto"`` to the checkpoint's dtype before calling this; called
        directly with ``auto``, the dtype is not checked (everything else is)."""
        problems = super().validate(config)
        if config.dtype != "auto" and getattr(torch, config.dtype) not in cls.supported_dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            problems.append(f"attention {cls.name!r} does not support dtype={config.dtype}; use one of {names}")
        device_type = torch.device(config.device).type
        if device_type not in cls.supported_devices:
            problems.append(f"attention {cls.name!r} runs on {', '.join(cls.supported_devices)}, not "
                            f"device={config.device}")
        if config.block_size % cls.block_size_multiple:
            problems.append(f"attention {cls.name!r} needs block_size to be a multiple of {cls.block_size_multiple} "
                            f"(its paged-KV kernel's page size), got engine.block_size={config.block_size}")
        if getattr(config, "enforce_eager", None) is False:  # decode CUDA graphs asked for explicitly
            if not cls.supports_cuda_graphs:
                problems.append(f"attention {cls.name!r} cannot be captured in CUDA graphs (it plans each step on the "
                                "host); set engine.enforce_eager=true or null, or use attention=triton")
            elif device_type != "cuda":
                problems.append(f"CUDA graphs need device=cuda, got device={config.device}; set "
                                "engine.enforce_eager=true or null")
            elif config.tensor_parallel_size > 1:
                problems.append("decode CUDA graphs are not captured under tensor parallelism; set "
                                "engine.enforce_eager=true or null with parallel.tensor_parallel_size > 1")
        if config.kv_cache_dtype not in cls.supported_kv_cache_dtypes:
            problems.append(f"attention {cls.name!r} does not support kv_cache_dtype={config.kv_cache_dtype}; use "
                            f"one of {', '.join(cls.supported_kv_cache_dtypes)} (attention=torch_paged or torch support int8, fp8_e4m3)")
        return problems

    @classmethod
    def validate_model(cls, layers: Sequence[AttentionLayerSpec], config: EngineConfig | None = None) -> list[str]:
        """Capability check against the model's per-layer attention, before weights load.

        Called by ``framework.build_engine`` (``inspect_model``) with the layers read from
        ``config.json``: head sizes (``supported_head_sizes``), GQA, and each layer feature
        (:data:`CAPABILITY_OF`) against the ``supports_*`` attributes. ``config`` lets a composite
        backend (``hybrid``) check its parts.

        Returns:
            Problems naming a fix; empty when the backend can run this model.
        """
        problems = []
        shapes = {(layer.num_heads, layer.num_kv_heads, layer.cache_head_size) for layer in layers}
        for num_heads, num_kv_heads, head_size in sorted(shapes):
            if cls.supported_head_sizes is not None and head_size not in cls.supported_head_sizes:
                problems.append(f"attention {cls.name!r} supports head sizes {list(cls.supported_head_sizes)}, "
                                f"the model has head_size={head_size}; use attention=torch")
            if num_heads % num_kv_heads:
                problems.append(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        for feature, description in required_features(layers).items():
            if not getattr(cls, CAPABILITY_OF[feature]):
                problems.append(f"attention {cls.name!r} has no {description}, which this model needs")
        return problems + latent_kv_problems(layers, config)

    def get_kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache. Default ``(2, num_blocks, block_size, num_kv_heads, head_size)``;
        a latent (MLA) cache ``(1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim)``."""
        return (1 if self.latent_kv else 2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def kv_cache_bytes_per_block(self, num_layers: int) -> int:
        """Bytes one block costs across all layers (K and V, plus scales if any), for sizing the pool."""
        per_layer = math.prod(self.get_kv_cache_shape(1))
        return per_layer * num_layers * torch.empty((), dtype=self.cache_dtype).element_size()

    def copy_blocks(self, src_caches: list[torch.Tensor], src_block_ids: list[int],
                    dst_caches: list[torch.Tensor], dst_block_ids: list[int]) -> None:
        """Copy whole KV blocks between two sets of per-layer caches (swap out / swap in).

        Called by the model runner at the start of a step for ``preemption_mode=swap``. The default
        copies every layer's tensor along dimension 1 (the block dimension of
        :meth:`get_kv_cache_shape`); a backend whose cache holds more per block (e.g. quantization
        scales) overrides this so that everything a block holds moves with it.

        Args:
            src_caches, dst_caches: one tensor per layer, shaped like :meth:`get_kv_cache_shape`
                (possibly on different devices: GPU <-> CPU swap space).
            src_block_ids, dst_block_ids: equal-length block ids; ``src[i]`` goes to ``dst[i]``.
        """
        if not src_block_ids:
            return
        src_idx = torch.tensor(src_block_ids, device=src_caches[0].device)
        dst_idx = torch.tensor(dst_block_ids, device=dst_caches[0].device)
        for src, dst in zip(src_caches, dst_caches, strict=True):
            dst.index_copy_(1, dst_idx, src.index_select(1, src_idx).to(dst.device))

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """Per-step, backend-specific metadata (index tensors, masks, planned kernels).

        Called by the model runner once per step, before the forward; the result is passed to
        every layer's :meth:`forward`.
        """

    @abstractmethod
    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any, **features: Any) -> torch.Tensor:
        """Write this step's K/V into the cache and attend.

        Args:
            layer_idx: decoder layer index.
            query: ``(num_tokens, num_heads, head_size)``, model dtype.
            key, value: ``(num_tokens, num_kv_heads, head_size)``, post-RoPE, model dtype.
            kv_cache: this layer's cache, shape :meth:`get_kv_cache_shape`; mutated in place at
                ``slot_mapping``.
            metadata: what :meth:`build_metadata` returned for this step.
            features: keyword arguments of this call, each passed only when the layer uses it (what
                transformers 5 passes the attention function, checked by the bridge against
                ``layers[layer_idx]``): ``scale`` (float, softmax scale, passed when it differs from
                ``self.scale``, e.g. GPT-2's per-layer scaling), ``sliding_window`` (int W: a query
                at position p sees keys at positions > p - W), ``softcap`` (float c: scores
                become ``c * tanh(scores / c)`` after scaling, before the mask; Gemma 2) and
                ``sinks`` (``(num_heads,)`` tensor: per-head logits that join the softmax
                denominator only; gpt-oss). A backend receives only features its ``supports_*``
                attributes declare (:meth:`validate_model` refuses other models). Keys outside a
                query's window may sit in blocks that no longer hold them (a sliding KV cache group's
                released entries point at the null block, id ``num_blocks``: zeros, never written, so
                gathers stay in bounds and finite): mask by position.

        Returns:
            ``(num_tokens, num_heads, head_size)`` attention output (causal within each request,
            over its cached context plus its own earlier query tokens).
        """

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store K/V of some tokens at their cache slots, in this backend's layout (what
        :meth:`forward` does before attending; vLLM's ``reshape_and_cache``). The default is the
        ``NHD`` layout of :meth:`get_kv_cache_shape`; a backend with another layout (e.g.
        ``torch_paged``'s transposed key blocks) or a quantized cache overrides it.

        Args:
            kv_cache: one layer's cache, mutated in place.
            key, value: ``(num_tokens, num_kv_heads, head_size)``, any float dtype.
            slot_mapping: ``(num_tokens,)`` int64, slot = block_id * block_size + offset.
        """
        flat = (-1, kv_cache.shape[-2], kv_cache.shape[-1])
        kv_cache[0].view(flat).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(flat).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V stored at ``slots`` (the inverse of :meth:`write_kv`, for tests and tools).

        Returns:
            Two ``(len(slots), num_kv_heads, head_size)`` tensors (copies; a quantized cache
            returns dequantized ``float32`` values).
        """
        return tuple(kv_cache[i].reshape(-1, kv_cache.shape[-2], kv_cache.shape[-1])[slots] for i in (0, 1))

    def traceable_inputs(self, metadata: Any) -> Any | None:
        """Inputs of :meth:`traceable_forward` for this step, or ``None`` (the default) when the step
        must go through :meth:`forward`.

        With ``engine.compile=true`` the model runner asks once per step. When this returns
        something, the compiled decoder is called with it (and the layers' caches) as graph inputs
        and each layer calls :meth:`traceable_forward`, which dynamo traces into the decoder graph:
        no opaque per-layer call, and inductor fuses the attention with the work around it. What
        it returns is a dataclass (or dict) of tensors whose batch dims the backend has marked
        dynamic (``torch._dynamo.maybe_mark_dynamic``); steps that return ``None`` run the same
        compiled decoder with attention as the opaque op (another graph, compiled at warm-up).
        """
        return None

    def traceable_forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, inputs: Any, **features: Any) -> torch.Tensor:
        """:meth:`forward` as code dynamo can trace (same arguments, features and result; ``inputs`` is
        what :meth:`traceable_inputs` returned). Cache writes must go through an op that declares the
        cache mutated (``Tensor(a!)`` in its schema), so inductor keeps them in place.

        The default runs :meth:`forward` with ``inputs`` as its metadata: enough for a backend whose
        ``forward`` is already traceable and whose ``traceable_inputs`` returns the step's metadata.
        """
        return self.forward(layer_idx, query, key, value, kv_cache, inputs, **features)
