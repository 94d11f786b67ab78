"""Per-step forward state and the bridge from transformers' attention to our backend.

The model runner enters :func:`forward_context` around each forward; transformers' decoder
layers call :func:`servelab_attention` (registered as attention implementation ``"servelab"``
in transformers' ``AttentionInterface``), which forwards to the selected backend with this
step's metadata and the layer's KV cache. No module globals hold step state: it lives in a
``ContextVar`` set only inside the ``with`` block.

Under ``torch.compile`` (``engine.compile=true``) the attention call is the custom op
``torch.ops.servelab.attention`` instead, so dynamo sees one opaque node per layer (vLLM's
``unified_attention`` pattern): the op's real implementation reads the same ``ContextVar`` at run
time, and its fake implementation gives dynamo/inductor the output shape. Eager runs keep the
direct call (no dispatcher round trip per layer).

A backend whose attention is itself traceable (``AttentionBackend.traceable_inputs`` returns
something for the step, e.g. ``torch_paged`` on an all-decode step) is instead traced into the
compiled graph: the model runner passes a :class:`GraphAttention` to the decoder as the keyword
``servelab_graph``, transformers forwards it to every attention call, and
:func:`servelab_attention` calls ``backend.traceable_forward`` with the layer's cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from framework.interfaces import AttentionBackend
from framework.interfaces.attention import FEATURE_NAMES, LAYER_FEATURES
from framework.model_executor import mla

ATTN_IMPLEMENTATION = "servelab"


@dataclass
class ForwardContext:
    """What every attention layer needs during one forward."""

    backend: AttentionBackend  # the selected backend instance
    metadata: Any  # backend.build_metadata(common) for this step
    kv_caches: list[torch.Tensor]  # one per decoder layer, backend.get_kv_cache_shape(num_blocks) (may be shared)
    # per decoder layer: the metadata of its KV cache group (several groups: each has its own block
    # table, framework/core/kv_cache_groups.py); None: ``metadata`` serves every layer
    layer_metadata: list[Any] | None = None
    # the step's LoRA state (framework.model_executor.lora_layers.LoRAStep) read by LoRA-wrapped linears;
    # None: no adapters (LoRA off, or a forward that is not a step: warm-up, profiling)
    lora: Any = None

    def metadata_of(self, layer_idx: int) -> Any:
        """The metadata layer ``layer_idx`` attends with."""
        return self.metadata if self.layer_metadata is None else self.layer_metadata[layer_idx]


@dataclass
class GraphAttention:
    """Attention state passed into the compiled decoder layers as graph inputs (keyword ``servelab_graph``).

    Dynamo lifts every tensor a layer graph reads from it (its KV cache group's inputs) to a graph
    input and guards on the backend object, so one graph serves every step that takes this path.
    """

    backend: AttentionBackend  # the selected backend instance
    kv_caches: list[torch.Tensor]  # one per decoder layer, backend.get_kv_cache_shape(num_blocks) (may be shared)
    inputs: Any  # backend.traceable_inputs(metadata) for this step (KV cache group 0)
    layer_inputs: list[Any] | None = None  # per decoder layer: its KV cache group's inputs; None: ``inputs``
    group_inputs: list[Any] | None = None  # per KV cache group: its inputs; None: ``inputs``

    def inputs_of(self, layer_idx: int) -> Any:
        """The traced inputs layer ``layer_idx`` attends with."""
        return self.inputs if self.layer_inputs is None else self.layer_inputs[layer_idx]

    def for_group(self, group: int) -> GraphAttention:
        """This step's state as one layer of KV cache group ``group`` sees it: ``inputs`` are the group's,
        and no per-group or per-layer lists. A compiled layer given this view reads its attention
        inputs from one place whatever its group (``servelab_graph.inputs``), so layers of one type in
        several groups share a graph (``compile_regions.LayerGraphs``); ``self`` when there is one group."""
        if self.group_inputs is None:
            return self
        return GraphAttention(self.backend, self.kv_caches, self.group_inputs[group])


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("servelab_forward_context", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the current forward context for the duration of the block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def current_lora() -> Any:
    """The current forward's LoRA state (``ForwardContext.lora``); ``None`` outside a forward or without one."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.lora


def servelab_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None,
                       dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: paged attention through the current backend.

    Reads what transformers 5 passes besides q/k/v (``scaling``, ``sliding_window``, ``softcap``,
    ``s_aux``, ``is_causal``) and hands it to the backend as :meth:`AttentionBackend.forward`'s
    features; every call is checked against the backend's ``layers[layer_idx]`` (the spec built from
    ``config.json`` that ``validate_model`` judged), so a call the spec did not foresee raises instead
    of computing something else. Head counts and sizes come from the tensors. When the value head
    size differs from the key head size (MLA), the smaller of the two is zero-padded to the cache's
    head size (zero query/key channels add nothing to the scores; zero value channels are cut from
    the output). A module routed through MLA's latent cache (``framework/model_executor/mla.py``) passes
    the latents as one KV head: its query is absorbed before the backend and its output projected to
    ``v_head_dim`` after.

    Args:
        module: the transformers attention module (provides ``layer_idx``; ``is_causal`` if no kwarg).
        query: ``(1, num_heads, num_tokens, head_size)``; key ``(1, num_kv_heads, num_tokens, head_size)``,
            value ``(1, num_kv_heads, num_tokens, value_head_size)`` — the whole flattened batch is one
            "sequence".
        attention_mask: ignored; causality, windows and request boundaries come from the metadata.
        scaling: softmax scale of this layer.
        kwargs: transformers' extras; ``servelab_graph`` (a :class:`GraphAttention`) selects the traced path.

    Returns:
        ``((1, num_tokens, num_heads, value_head_size), None)``, as transformers expects.

    Raises:
        RuntimeError: called outside :func:`forward_context`, a non-causal call, or a call that
            disagrees with the layer's spec or needs a feature the backend lacks.
    """
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise RuntimeError(f"layer {module.layer_idx}: non-causal attention (is_causal=False) is not supported")
    window = kwargs.get("sliding_window") or None
    softcap = kwargs.get("softcap") or None
    sinks = kwargs.get("s_aux")
    latent = getattr(module, mla.MARK, None) is not None  # MLA over the latent cache: attend in latent space
    if latent:
        query = mla.absorb_query(module, query)
    value_head_size = value.shape[-1]
    if key.shape[-1] != value_head_size:  # MLA
        query, key, value = _pad_head_size(query, key, value)
    graph = kwargs.get("servelab_graph")
    handle = kwargs.get("servelab_layer")  # a compiled layer's LayerHandle (framework/compilation/regions.py)
    layer_idx = module.layer_idx if handle is None else handle.spec_layer
    if graph is not None:  # traced into the compiled layer (or run eagerly: same math)
        features = call_features(graph.backend, layer_idx, query, key, scaling, window, softcap, sinks)
        if handle is None:
            layer, kv_cache, inputs = layer_idx, graph.kv_caches[layer_idx], graph.inputs_of(layer_idx)
        else:  # the layer's identity is data: one graph serves every layer of its kind, whatever its group
            if graph.group_inputs is not None:
                raise RuntimeError("a compiled layer is given its KV cache group's view of the step "
                                   "(GraphAttention.for_group), not every group's inputs")
            layer, kv_cache, inputs = handle.index, handle.kv_cache, graph.inputs
        out = graph.backend.traceable_forward(layer, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                              value[0].transpose(0, 1), kv_cache, inputs, **features).unsqueeze(0)
    elif handle is not None and torch.compiler.is_compiling():  # keep the backend call out of the graph
        out = torch.ops.servelab.attention(query, key, value, handle.index, scaling, window, softcap, sinks)
    else:
        out = _attention(query, key, value, module.layer_idx, scaling, window, softcap, sinks)
    out = out if out.shape[-1] == value_head_size else out[..., :value_head_size]
    return (mla.project_output(module, out) if latent else out), None


def _pad_head_size(query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad query/key or value channels so both have ``max(key head size, value head size)``."""
    qk_size, v_size = key.shape[-1], value.shape[-1]
    if qk_size < v_size:
        query, key = (torch.nn.functional.pad(t, (0, v_size - qk_size)) for t in (query, key))
    elif v_size < qk_size:
        value = torch.nn.functional.pad(value, (0, qk_size - v_size))
    return query, key, value


#: The fields of ``AttentionBackend.call_signatures`` (one tuple per layer), in order.
CALL_FIELDS = ("num_heads", "num_kv_heads", "cache_head_size", "sliding_window", "softcap", "has_sinks")


def call_features(backend: AttentionBackend, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                  scale: float | None, sliding_window: int | None, softcap: float | None,
                  sinks: torch.Tensor | None) -> dict[str, Any]:
    """The keyword features of ``backend.forward`` for one call, after checking the call against the
    backend's ``layers[layer_idx]`` (``call_signatures``) and capabilities (plain Python on the call's
    constants: under ``torch.compile`` it runs while tracing; eagerly ~1 us per layer when all agree).

    Args:
        query, key: ``(1, heads, num_tokens, cache_head_size)`` (padded) as passed to the backend.

    Returns:
        ``scale`` (only when it differs from ``backend.scale``), ``sliding_window``, ``softcap``,
        ``sinks`` — each only when set.

    Raises:
        RuntimeError: the call's heads, head size or features differ from the layer's spec (a model
            whose ``config.json`` the family rules read wrongly), or the backend lacks a feature.
    """
    call = (query.shape[1], key.shape[1], query.shape[-1], sliding_window or None, softcap or None, sinks is not None)
    signatures = backend.call_signatures
    if layer_idx >= len(signatures) or call != signatures[layer_idx]:
        _check_call(backend, layer_idx, call)
    features: dict[str, Any] = {}
    if scale is not None and scale != backend.scale:
        features["scale"] = float(scale)
    if call[3]:
        features["sliding_window"] = int(sliding_window)
    if call[4]:
        features["softcap"] = float(softcap)
    if call[5]:
        features["sinks"] = sinks
    return features


def _check_call(backend: AttentionBackend, layer_idx: int, call: tuple) -> None:
    """Raise unless ``call`` (a :data:`CALL_FIELDS` tuple) is one the backend can run as described.

    A backend built without per-layer specs (``layers`` empty) accepts its own shape and any feature
    it declares; otherwise the call must equal the layer's spec.
    """
    given = dict(zip(CALL_FIELDS, call))
    if layer_idx < len(backend.call_signatures):
        expected = dict(zip(CALL_FIELDS, backend.call_signatures[layer_idx]))
    else:
        expected = {"num_heads": backend.num_heads, "num_kv_heads": backend.num_kv_heads,
                    "cache_head_size": backend.head_size}
    wrong = {name: (given[name], want) for name, want in expected.items() if given[name] != want}
    if wrong:
        detail = ", ".join(f"{name}={got!r} (config.json says {want!r})" for name, (got, want) in wrong.items())
        raise RuntimeError(f"layer {layer_idx}: transformers called attention with {detail}; servelab's reading of "
                           "this architecture (framework/model_executor/model_families.py) is out of date: please report it")
    for feature, attribute in LAYER_FEATURES.items():
        if given[feature] and not getattr(backend, attribute):
            raise RuntimeError(f"layer {layer_idx}: attention {backend.name!r} has no {FEATURE_NAMES[feature]}; "
                               "use attention=torch_paged or attention=torch")


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int, scale: float | None,
               sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The backend call of :func:`servelab_attention`: ``(1, num_tokens, num_heads, head_size)``."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("servelab attention called outside forward_context(); "
                           "load the model through framework.worker.model_runner.ModelRunner")
    features = call_features(ctx.backend, layer_idx, query, key, scale, sliding_window, softcap, sinks)
    out = ctx.backend.forward(layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                              value[0].transpose(0, 1), ctx.kv_caches[layer_idx], ctx.metadata_of(layer_idx),
                              **features)
    return out.unsqueeze(0)


# The KV cache is not an argument: it is reached through the forward context by the layer index (a
# tensor argument: data, so every layer of a kind runs one graph), like the metadata, so
# mutates_args is empty although the op writes the layer's cache at slot_mapping. That hidden
# write is safe because nothing else in the compiled graph reads or writes a cache (layer i's op
# is ordered after layer i-1's by data dependence, and each layer touches only its own cache), and
# the op's output is always used, so it is never dead-code eliminated. Passing 2 x num_layers cache
# tensors plus backend-specific metadata as arguments would tie the op's schema to one backend.
# The layer's features are arguments (constants of the traced graph; the sinks a weight input).
@torch.library.custom_op("servelab::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor,
                 scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention of one layer through the current forward context's backend (opaque to dynamo).

    Args:
        query: ``(1, num_heads, num_tokens, head_size)``, model dtype.
        key, value: ``(1, num_kv_heads, num_tokens, head_size)``, post-RoPE, model dtype.
        layer: ``()`` int64 CPU tensor, the decoder layer's index: data, not a constant of the traced
            graph, so one compiled layer graph serves every layer of its kind.
        scale, sliding_window, softcap, sinks: the layer's call features (see
            :meth:`AttentionBackend.forward`); ``None`` when unused.

    Returns:
        A new ``(1, num_tokens, num_heads, head_size)`` tensor in ``query.dtype``. Side effect: this
        step's K/V are written into ``ctx.kv_caches[layer]``.

    Raises:
        RuntimeError: when called outside :func:`forward_context`, or as :func:`call_features`.
    """
    # contiguous: inductor lays out the consumer with the fake's (contiguous) strides, while e.g.
    # the torch backend's empty_like(query) output keeps the transposed query's strides
    out = _attention(query, key, value, int(layer), scale, sliding_window, softcap, sinks).contiguous()
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (query, key, value)):
        out = out.clone()  # a custom op's output may not alias an input
    return out


@attention_op.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: torch.Tensor,
                    scale: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Shape-only version for tracing: ``(1, num_tokens, num_heads, head_size)`` like ``query``."""
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


_PREPARED_MASKS: dict[torch.device, torch.Tensor] = {}


def prepared_mask(device: torch.device) -> torch.Tensor:
    """The ``attention_mask`` the runner passes to a decoder: a 4-D bool mask with no elements,
    ``(1, 1, 0, 0)`` on ``device`` (one per device, reused).

    transformers' mask builders (``create_causal_mask``, the sliding-window and bidirectional ones)
    return a 4-D ``attention_mask`` as they get it. Given none, they work out the step's query and
    key lengths and look for packed sequences in ``position_ids`` (a diff, a cumsum and a host sync):
    ~150 us a step on a 2-core CPU for a mask :func:`servelab_attention` ignores (the backend masks
    from its metadata).
    """
    mask = _PREPARED_MASKS.get(device)
    if mask is None:
        mask = _PREPARED_MASKS[device] = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)
    return mask


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for ``"servelab"``: the backend builds its own masks from the metadata."""
    return None


def register_attention_implementation() -> str:
    """Register ``"servelab"`` with transformers' attention and mask interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, servelab_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
