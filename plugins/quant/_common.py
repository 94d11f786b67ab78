"""Shared machinery of the weight-quant methods: which linears to quantize, byte accounting.

Every method rewrites the ``nn.Linear`` layers of the decoder stack (``model.model``) after the
weights load (gpt-fast's transform-the-finished-model approach); the model code knows nothing of it.
``lm_head`` and ``embed_tokens`` are never quantized: both shipped models tie ``lm_head.weight`` to
``embed_tokens.weight``, so the shared tensor stays full precision and the tie stays intact
(quantizing the tied head would either break the tie or quantize the embedding lookup too).

Per family: MoE experts (Mixtral, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek) are fused 3-D parameters in
transformers 5, not ``nn.Linear``, so they and the routers stay in the model dtype (logged); their
attention projections, dense and shared-expert MLPs are quantized. GPT-2's projections are
transformers ``Conv1D`` layers: nothing to quantize, refused before loading.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from framework.interfaces import QuantMethod

logger = logging.getLogger(__name__)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly torchao tensor-subclass) tensor really stores: its inner tensors summed."""
    if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
    return t.numel() * t.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, shared (tied) tensors counted once."""
    seen, total = set(), 0
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())
    for _, t in tensors:
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += tensor_bytes(t)
    return total


#: Model types whose decoder projections are transformers ``Conv1D`` (not ``nn.Linear``).
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt"})


class LinearQuantMethod(QuantMethod):
    """Base of the weight-quant methods: selects the decoder's linears, logs bytes before/after.

    Params (``quant.params.*``):
        skip: module-name suffixes left in full precision (e.g. ``[down_proj]``); default none.

    Subclasses implement :meth:`quantize_linears` and may extend :meth:`validate`.
    """

    def __init__(self, skip: list[str] | tuple[str, ...] = (), **params: Any) -> None:
        super().__init__(**params)
        self.skip = tuple(skip)
        self.backend_note = ""  # what kernel runs, set by quantize_linears; logged

    @classmethod
    def validate(cls, config: Any) -> list[str]:
        """The model's decoder has ``nn.Linear`` projections (read from ``config.json``)."""
        problems = super().validate(config)
        from framework.model_executor.model_loader import load_model_config

        try:
            model_type = load_model_config(config.model).model_type
        except (OSError, ValueError):  # a missing model is reported by the model checks
            return problems
        if model_type in CONV1D_MODEL_TYPES:
            problems.append(f"quant={cls.name}: {model_type}'s projections are transformers Conv1D layers, which "
                            "servelab's quant methods do not rewrite; use quant=none")
        return problems

    def selected(self, name: str, module: torch.nn.Module) -> bool:
        """True for the decoder ``nn.Linear`` layers this method quantizes (``name`` relative to ``model.model``)."""
        # a tensor-parallel wrapper's shard is its child ``linear`` (framework/model_executor/parallel_layers.py):
        # ``skip`` names the wrapper
        names = (name, name.removesuffix(".linear"))
        return isinstance(module, torch.nn.Linear) and not any(n.endswith(s) for n in names for s in self.skip)

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        """Quantize the decoder's linears in place (``lm_head``/embedding untouched); returns ``model``.

        Raises:
            ValueError: the decoder has no linear this method selects (nothing would be quantized).
        """
        before = weight_bytes(model)
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        if not any(self.selected(name, module) for name, module in decoder.named_modules()):
            raise ValueError(f"quant={self.name}: {type(model).__name__}'s decoder has no nn.Linear to quantize; "
                             "use quant=none")
        experts = [t for _, t in decoder.named_parameters() if t.dim() == 3]  # fused MoE experts (E, out, in)
        self.quantize_linears(decoder)
        after = weight_bytes(model)
        logger.info("quant=%s: weights %.2f MiB -> %.2f MiB (%s); lm_head and embed_tokens kept full precision",
                    self.name, before / 2**20, after / 2**20, self.backend_note)
        if experts:
            logger.info("quant=%s: %d fused MoE expert tensors (%.2f MiB) and the routers kept in the model dtype",
                        self.name, len(experts), sum(tensor_bytes(t) for t in experts) / 2**20)
        return model

    @abstractmethod
    def quantize_linears(self, decoder: torch.nn.Module) -> None:
        """Replace/convert the selected linears of ``decoder`` in place."""


def torchao_quantize(decoder: torch.nn.Module, ao_config: Any, method: LinearQuantMethod) -> None:
    """Run torchao's ``quantize_`` with ``ao_config`` on the linears ``method`` selects."""
    from torchao.quantization import quantize_

    quantize_(decoder, ao_config, filter_fn=lambda module, fqn: method.selected(fqn, module))


def replace_linears(decoder: torch.nn.Module, method: LinearQuantMethod,
                    make: Callable[[torch.nn.Linear], torch.nn.Module]) -> None:
    """Swap every linear ``method`` selects for ``make(linear)`` (a module with the same call shape)."""
    targets = [(n, m) for n, m in decoder.named_modules() if method.selected(n, m)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = decoder.get_submodule(parent_name) if parent_name else decoder
        setattr(parent, child, make(module))
