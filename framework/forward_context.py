"""Per-step forward state and the bridge from transformers' attention to our backend.

The model runner enters :func:`forward_context` around each forward; transformers' decoder
layers call :func:`servelab_attention` (registered as attention implementation ``"servelab"``
in transformers' ``AttentionInterface``), which forwards to the selected backend with this
step's metadata and the layer's KV cache. No module globals hold step state: it lives in a
``ContextVar`` set only inside the ``with`` block.
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

    Returns:
        ``((1, num_tokens, num_heads, head_size), None)``, as transformers expects.

    Raises:
        RuntimeError: when called outside :func:`forward_context`.
    """
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError("servelab attention called outside forward_context(); "
                           "load the model through framework.model_runner.ModelRunner")
    layer_idx = module.layer_idx
    out = ctx.backend.forward(layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                              value[0].transpose(0, 1), ctx.kv_caches[layer_idx], ctx.metadata)
    return out.unsqueeze(0), None


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
