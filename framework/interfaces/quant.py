"""Quant method: a transform applied to a loaded model (gpt-fast style), plus the KV dtype."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from framework.interfaces.base import Plugin


class QuantMethod(Plugin, ABC):
    """Rewrites a finished ``torch.nn.Module`` (e.g. swaps ``nn.Linear`` for int8 weight-only
    linears); the model definition knows nothing of it. Config ``quant=none`` applies none.
    """

    def __init__(self, **params: Any) -> None:
        self.params = params

    @abstractmethod
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Quantize ``model`` in place or return a replacement.

        Called by the model loader once, after weights load and before the KV cache is sized.
        """

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Dtype of the KV cache; default the model dtype (no KV-cache quantization)."""
        return model_dtype
