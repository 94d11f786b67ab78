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

ATTN_IMPLEMENTATION = "servelab"


@dataclass
class ForwardContext:
    """What every attention layer needs during one forward."""

    backend: AttentionBackend  # the selected backend instance
    metadata: Any  # backend.build_metadata(common) for this step
    kv_caches: list[torch.Tensor]  # one per decoder layer, backend.get_kv_cache_shape(num_blocks)


@dataclass
class GraphAttention:
    """Attention state passed into a compiled decoder as graph inputs (keyword ``servelab_graph``).

    Dynamo lifts every tensor reachable from it (the caches, the inputs' tensors) to a graph input
    and guards on the backend object, so one graph serves every step that takes this path.
    """

    backend: AttentionBackend  # the selected backend instance
    kv_caches: list[torch.Tensor]  # one per decoder layer, backend.get_kv_cache_shape(num_blocks)
    inputs: Any  # backend.traceable_inputs(metadata) for this step


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("servelab_forward_context", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` the current forward context for the duration of the block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def servelab_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None,
                       dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: paged attention through the current backend.

    Args:
        module: the transformers attention module (provides ``layer_idx``).
        query: ``(1, num_heads, num_tokens, head_size)``; key/value ``(1, num_kv_heads,
            num_tokens, head_size)`` — the whole flattened batch is one "sequence".
        attention_mask: ignored; causality and request boundaries come from the metadata.
        kwargs: transformers' extras; ``servelab_graph`` (a :class:`GraphAttention`) selects the traced path.

    Returns:
        ``((1, num_tokens, num_heads, head_size), None)``, as transformers expects.

    Raises:
        RuntimeError: when called outside :func:`forward_context`.
    """
    graph = kwargs.get("servelab_graph")
    if graph is not None:  # traced into the compiled decoder (or run eagerly: same math)
        out = graph.backend.traceable_forward(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                              value[0].transpose(0, 1), graph.kv_caches[module.layer_idx],
                                              graph.inputs)
        return out.unsqueeze(0), None
    if torch.compiler.is_compiling():  # dynamo is tracing: keep the backend call out of the graph
        return torch.ops.servelab.attention(query, key, value, module.layer_idx), None
    return _attention(query, key, value, module.layer_idx), None


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """The backend call of :func:`servelab_attention`: ``(1, num_tokens, num_heads, head_size)``."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("servelab attention called outside forward_context(); "
                           "load the model through framework.worker.model_runner.ModelRunner")
    out = ctx.backend.forward(layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                              value[0].transpose(0, 1), ctx.kv_caches[layer_idx], ctx.metadata)
    return out.unsqueeze(0)


# The KV cache is not an argument: it is reached through the forward context, like the metadata,
# so mutates_args is empty although the op writes the layer's cache at slot_mapping. That hidden
# write is safe because nothing else in the compiled graph reads or writes a cache (layer i's op
# is ordered after layer i-1's by data dependence, and each layer touches only its own cache), and
# the op's output is always used, so it is never dead-code eliminated. Passing 2 x num_layers cache
# tensors plus backend-specific metadata as arguments would tie the op's schema to one backend.
@torch.library.custom_op("servelab::attention", mutates_args=())
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Paged attention of one layer through the current forward context's backend (opaque to dynamo).

    Args:
        query: ``(1, num_heads, num_tokens, head_size)``, model dtype.
        key, value: ``(1, num_kv_heads, num_tokens, head_size)``, post-RoPE, model dtype.
        layer_idx: decoder layer index (a constant of the traced graph).

    Returns:
        A new ``(1, num_tokens, num_heads, head_size)`` tensor in ``query.dtype``. Side effect: this
        step's K/V are written into ``ctx.kv_caches[layer_idx]``.

    Raises:
        RuntimeError: when called outside :func:`forward_context`.
    """
    # contiguous: inductor lays out the consumer with the fake's (contiguous) strides, while e.g.
    # the torch backend's empty_like(query) output keeps the transposed query's strides
    out = _attention(query, key, value, layer_idx).contiguous()
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (query, key, value)):
        out = out.clone()  # a custom op's output may not alias an input
    return out


@attention_op.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """Shape-only version for tracing: ``(1, num_tokens, num_heads, head_size)`` like ``query``."""
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


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
