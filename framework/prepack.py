"""``engine.prepack_linears``: CPU linears with weights reordered once into oneDNN's blocked layout.

ATen's bf16/fp16 ``linear`` on CPU re-lays out the weight on every call; for a decode step (a few
rows) that dominates, and bf16 GEMV ran at ~14 GB/s here against ~36 GB/s with the weight
prepacked (``experiments/roofline.py``: linears were 5.5x their bandwidth bound at batch 1). The
same reorder is what inductor's freezing does for compiled CPU graphs (``engine.compile_freezing``)
and what IPEX calls weight prepacking; this applies it to the eager model: every plain
``nn.Linear`` becomes a :class:`PrepackedLinear` calling ``torch.ops.mkldnn._linear_pointwise``.

``auto`` (the default) prepacks on CPU for bfloat16/float16 models run eagerly. float32 models keep
ATen's kernels (their outputs are the transformers-parity reference), compiled runs leave linears
to inductor, and quantized linears (already replaced by a quant method) are untouched.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)
MODES = ("auto", "on", "off")


class PrepackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is also held in oneDNN's blocked layout (CPU).

    The original ``weight`` (and ``bias``) stay registered, so tied embeddings and code that reads
    ``.weight`` see the same Parameter; the packed copy costs one more weight's worth of memory.

    Args:
        linear: the layer to wrap; its weight is ``(out_features, in_features)`` in bf16/fp16/fp32.

    Raises:
        RuntimeError: oneDNN cannot reorder the weight (caller falls back to the plain layer).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)  # layout tuned for M=1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features) -> (..., out_features)``, same dtype as ``x``."""
        bias = None if self.bias is None else self.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self._packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def should_prepack(mode: str, device: torch.device, dtype: torch.dtype, compile: bool) -> bool:
    """Whether ``engine.prepack_linears=<mode>`` applies to this model.

    Raises:
        ValueError: unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"prepack_linears must be one of {MODES}, got {mode!r}")
    if mode == "off" or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return mode == "on" or (dtype in (torch.bfloat16, torch.float16) and not compile)


def prepack_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (CPU) by a :class:`PrepackedLinear`.

    Returns:
        The number of layers replaced (0 when oneDNN refuses; a warning says why).
    """
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    try:
        packed = [(parent, name, PrepackedLinear(child)) for parent, name, child in targets]
    except RuntimeError as err:
        logger.warning("prepack_linears: oneDNN cannot prepack (%s); keeping ATen linears", err)
        return 0
    for parent, name, layer in packed:
        setattr(parent, name, layer)
    return len(packed)
