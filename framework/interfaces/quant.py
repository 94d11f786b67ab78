"""Quant method: a transform applied to a loaded model (gpt-fast style), plus the KV dtype."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    from framework.config import EngineConfig


class QuantMethod(Plugin, ABC):
    """Rewrites a finished ``torch.nn.Module`` (e.g. swaps ``nn.Linear`` for int8 weight-only
    linears); the model definition knows nothing of it. Config ``quant=none`` applies none.

    A method that loads a pre-quantized checkpoint names its format in ``checkpoint_format``: the
    ``quantization_config.quant_method`` of ``config.json`` it reads (``"gptq"``, ``"awq"``,
    ``"compressed-tensors"``). The builder then chooses it for such a checkpoint when ``quant=none``
    and refuses any other ``quant=`` (``framework/model_executor/quantized_checkpoint.py``); the model
    loader builds the model without transformers' quantizer, and ``apply`` replaces the linears whose
    packed tensors the checkpoint holds.
    """

    #: ``config.json`` ``quantization_config.quant_method`` this method loads; None: it quantizes float weights
    checkpoint_format: ClassVar[str | None] = None

    def __init__(self, **params: Any) -> None:
        self.params = params

    @abstractmethod
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Quantize ``model`` in place or return a replacement.

        Called by the model loader once, after weights load and before the KV cache is sized.
        """

    @classmethod
    def validate_tp(cls, config: EngineConfig, tp_size: int) -> list[str]:
        """Explain why this method cannot quantize the model of ``config`` split over ``tp_size``
        tensor-parallel ranks (empty: it can).

        Called before the weights load when ``tensor_parallel_size > 1``, next to :meth:`validate`.
        Each rank then quantizes its own shard (``apply`` sees a model whose column-parallel linears
        hold a slice of the output features and whose row-parallel ones wrap an inner ``nn.Linear``
        holding a slice of the input features; the all-reduces stay in the activation dtype). The
        default accepts every ``tp_size``: per-output-channel scales of a column-parallel shard are
        the TP=1 scales of its rows, and a row-parallel shard's rows get scales of their own (over the
        input slice the rank holds: as fine or finer than TP=1). A method with shape rules (group-wise int4) checks the
        per-rank shapes from ``framework.model_executor.tensor_parallel.linear_shapes``.
        """
        return []

    def kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Dtype of the KV cache; default the model dtype (no KV-cache quantization)."""
        return model_dtype
