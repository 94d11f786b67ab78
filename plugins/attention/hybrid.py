"""Hybrid attention: one backend for prefill/chunks, another for decodes (mini-sglang's ``fa,fi``).

``attention=hybrid attention.params.prefill=flash_attn attention.params.decode=flashinfer`` runs
each segment of a step through its own backend over one shared KV cache. Both backends must use
the same cache layout. The step's K/V are written once, before either backend attends, so the
contract "all of a step's K/V is in the cache before any read" holds across the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from framework import hookimpl, registry
from framework.hookspecs import Register
from framework.interfaces import AttentionBackend, AttentionLayerSpec, CommonAttentionMetadata
from framework.interfaces.attention import LAYER_FEATURES
from plugins.attention._paged_metadata import split_decode_prefill

if TYPE_CHECKING:
    from framework.config import EngineConfig


@dataclass
class HybridMetadata:
    """Per-step metadata: each part's own backend metadata (``None`` when the step has no such part)."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64, the whole step's slots
    num_decode_tokens: int  # leading decode tokens
    decode: Any  # decode backend's metadata of the decode part
    prefill: Any  # prefill backend's metadata of the prefill part


class HybridBackend(AttentionBackend):
    """Dispatches decode tokens to ``decode`` and prefill/chunk tokens to ``prefill`` backends.

    Args (beyond ``AttentionBackend``'s):
        prefill: registry name of the backend for prefills and chunks (e.g. ``flash_attn``).
        decode: registry name of the backend for decodes (e.g. ``flashinfer``).
        prefill_params, decode_params: extra parameters of each backend.

    Raises:
        ValueError: the two backends use different KV-cache layouts, a part names ``hybrid``, or a
            part cannot run the model's head shape.
        registry.UnknownPluginError: an unknown backend name.
    """

    name = "hybrid"
    # what both parts run (validate_model asks them; an instance sets these from its parts)
    supports_sliding_window = supports_softcap = supports_sinks = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float, block_size: int,
                 dtype: torch.dtype, device: torch.device, layers: Sequence[AttentionLayerSpec] | None = None,
                 prefill: str = "torch", decode: str = "torch", prefill_params: dict[str, Any] | None = None,
                 decode_params: dict[str, Any] | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_size, scale, block_size, dtype, device, layers)
        args = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
                    block_size=block_size, dtype=dtype, device=device, layers=layers)
        if "hybrid" in (prefill, decode):
            raise ValueError("attention=hybrid cannot nest itself; choose real backends for prefill and decode")
        specs = list(layers or ()) or [AttentionLayerSpec(num_heads, num_kv_heads, head_size, head_size)]
        for part in (prefill, decode):
            problems = registry.get_class("attention", part).validate_model(specs)
            if problems:
                raise ValueError("hybrid attention: " + "; ".join(problems))
        self.prefill_backend = registry.create("attention", prefill, **args, **(prefill_params or {}))
        self.decode_backend = registry.create("attention", decode, **args, **(decode_params or {}))
        if (self.prefill_backend.get_kv_cache_shape(1) != self.decode_backend.get_kv_cache_shape(1)
                or self.prefill_backend.kv_cache_layout != self.decode_backend.kv_cache_layout):
            raise ValueError(f"hybrid attention: {prefill!r} ({self.prefill_backend.kv_cache_layout}) and {decode!r} "
                             f"({self.decode_backend.kv_cache_layout}) use different KV-cache layouts; pair backends "
                             "with the same layout (torch_paged stores keys transposed: pair it with itself)")
        self.kv_cache_layout = self.prefill_backend.kv_cache_layout
        for attribute in LAYER_FEATURES.values():  # a feature runs when both parts run it
            setattr(self, attribute, all(getattr(b, attribute) for b in (self.prefill_backend, self.decode_backend)))

    @classmethod
    def _parts(cls, config: EngineConfig) -> list[type[AttentionBackend]]:
        params = config.attention_params
        return [registry.get_class("attention", params.get(part, "torch")) for part in ("prefill", "decode")]

    @classmethod
    def validate_model(cls, layers: Sequence[AttentionLayerSpec], config: EngineConfig | None = None) -> list[str]:
        """Both parts' model checks (they come from ``config``; without it, only the shape checks)."""
        if config is None:
            return super().validate_model(layers)
        return [f"hybrid part: {p}" for part in cls._parts(config) if part is not cls
                for p in part.validate_model(layers, config)]

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Both parts' capability checks, and that neither part is ``hybrid`` itself."""
        problems = []
        for part in cls._parts(config):
            if part is cls:
                problems.append("attention=hybrid cannot nest itself; choose real backends for prefill and decode")
                continue
            problems += part.validate(config)
        return problems

    def get_kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The (shared) layout of both parts."""
        return self.prefill_backend.get_kv_cache_shape(num_blocks)

    def write_kv(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """The (shared) layout's write; see ``AttentionBackend.write_kv``."""
        self.prefill_backend.write_kv(kv_cache, key, value, slot_mapping)

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (shared) layout's read; see ``AttentionBackend.read_kv``."""
        return self.prefill_backend.read_kv(kv_cache, slots)

    def build_metadata(self, common: CommonAttentionMetadata) -> HybridMetadata:
        """Split the step and let each part build its metadata for its own requests."""
        decode, prefill = split_decode_prefill(common)
        return HybridMetadata(
            slot_mapping=common.slot_mapping, num_decode_tokens=common.num_decode_tokens,
            decode=None if decode is None else self.decode_backend.build_metadata(decode),
            prefill=None if prefill is None else self.prefill_backend.build_metadata(prefill))

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: HybridMetadata, **features: Any) -> torch.Tensor:
        """Write all K/V first, then attend: decode tokens by ``decode``, the rest by ``prefill``.

        Each part rewrites its own slice of K/V (the same values), which is harmless. The first write
        is the shared layout's own (``write_kv``): an NHD write into ``torch_paged``'s transposed key
        blocks would overwrite other slots' keys.
        """
        self.write_kv(kv_cache, key, value, metadata.slot_mapping)
        nd = metadata.num_decode_tokens
        out = torch.empty_like(query)
        if metadata.decode is not None:
            out[:nd] = self.decode_backend.forward(layer_idx, query[:nd], key[:nd], value[:nd], kv_cache,
                                                   metadata.decode, **features)
        if metadata.prefill is not None:
            out[nd:] = self.prefill_backend.forward(layer_idx, query[nd:], key[nd:], value[nd:], kv_cache,
                                                    metadata.prefill, **features)
        return out


@hookimpl
def register_attention_backends(register: Register) -> None:
    """Register ``hybrid``."""
    register("hybrid", HybridBackend)
