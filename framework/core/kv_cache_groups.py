"""Which decoder layers share a block table, and which KV tensor holds each layer: the layout of vLLM's
hybrid KV-cache manager (``vllm/v1/core/kv_cache_utils.py``, KV cache groups of uniform page size).

Layers are grouped by attention type (full, or sliding with window W). A model of one type has one
group (Llama: full; Mistral: every layer windowed). A model mixing types (Gemma 2/3, gpt-oss, Qwen2
with ``max_window_layers``) splits each type into groups of the same number of layers, ``G`` =
the smallest type's layer count (or the largest, when the counts differ by less than 25%: fewer
groups, little padding). The runner allocates ``G`` KV tensors of ``num_blocks`` blocks; layer ``j``
of every group lives in tensor ``j``, so a block id names the same-sized page (``G`` layers x
``block_size`` tokens) whichever group owns it, and all groups draw from one pool: a Gemma-3 request
holds ``ceil(n / block_size)`` blocks in its full group but only about ``W / block_size`` in each
sliding group (the allocator releases the rest). Example, Gemma-3-1B (26 layers, every sixth full):
``G = 4``, one full group and six sliding groups (the last with two layers and two unused slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from framework.interfaces import AttentionLayerSpec, KVCacheGroup

#: Use the largest type's layer count as the group size when it is below this many times the smallest's.
PADDING_TOLERANCE = 1.25


def make_kv_cache_groups(layers: Sequence[AttentionLayerSpec], release_sliding_blocks: bool) -> tuple[KVCacheGroup, ...]:
    """KV cache groups of a model's layers (full-attention groups first, then windows ascending).

    Args:
        layers: one spec per decoder layer (``framework.model_executor.model_families.attention_layers``).
        release_sliding_blocks: the KV allocator releases out-of-window blocks
            (``KVAllocator.supports_kv_cache_groups``); ``False`` gives one full-attention group of
            every layer (windowed layers then mask by position over full block tables).

    Returns:
        The groups; each layer is in exactly one, and groups hold at most ``layers_per_block`` layers.
    """
    by_window: dict[int | None, list[int]] = {}
    for i, layer in enumerate(layers):
        by_window.setdefault(layer.sliding_window if release_sliding_blocks else None, []).append(i)
    if len(by_window) == 1:
        (window, ids), = by_window.items()
        return (KVCacheGroup(tuple(ids), window),)
    counts = [len(ids) for ids in by_window.values()]
    size = max(counts) if max(counts) < PADDING_TOLERANCE * min(counts) else min(counts)
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        ids = by_window[window]
        groups += [KVCacheGroup(tuple(ids[i:i + size]), window) for i in range(0, len(ids), size)]
    return tuple(groups)


@dataclass(frozen=True)
class KVCacheLayout:
    """The runner's view of :func:`make_kv_cache_groups`: KV tensors, and each layer's tensor and group.

    Raises:
        ValueError: a layer in no group or in two.
    """

    groups: tuple[KVCacheGroup, ...]
    num_layers: int  # decoder layers

    def __post_init__(self) -> None:
        seen = sorted(i for g in self.groups for i in g.layer_ids)
        if seen != list(range(self.num_layers)):
            raise ValueError(f"KV cache groups must cover each of the {self.num_layers} layers once, got {self.groups}")

    @classmethod
    def single(cls, num_layers: int) -> KVCacheLayout:
        """One full-attention group of every layer (what an allocator without groups gets)."""
        return cls((KVCacheGroup(tuple(range(num_layers))),), num_layers)

    @property
    def layers_per_block(self) -> int:
        """KV tensors the runner allocates: layers whose K/V one block holds (``G``)."""
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def has_null_block(self) -> bool:
        """Some group releases blocks, so the tensors get one more block: the null block."""
        return any(g.sliding_window is not None for g in self.groups)

    def tensor_of_layer(self) -> list[int]:
        """Per decoder layer, the index of the KV tensor holding it (its slot within its group)."""
        out = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layer_ids):
                out[layer] = slot
        return out

    def group_of_layer(self) -> list[int]:
        """Per decoder layer, the index of its group in :attr:`groups`."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layer_ids:
                out[layer] = g
        return out

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most, over all groups, when it is computed
        in chunks of at most ``max_chunk_tokens``: a full group ``ceil(num_tokens / block_size)``, a
        sliding group the ``W - 1`` keys before a chunk plus the chunk (one more block for alignment)."""
        full = -(-num_tokens // block_size)
        total = 0
        for group in self.groups:
            window = group.sliding_window
            total += full if window is None else min(full, -(-(window - 1 + max_chunk_tokens) // block_size) + 1)
        return total


def plan_kv_cache_layout(kv_allocator: str, layers: Sequence[AttentionLayerSpec]) -> KVCacheLayout:
    """The KV cache layout of a model under the registered allocator ``kv_allocator``: sliding-window
    groups of their own when the allocator declares ``supports_kv_cache_groups``, else one group of
    every layer. A pure function of its arguments, so the driver (``build_engine``) and every worker
    rank compute the same layout.

    Raises:
        registry.UnknownPluginError: ``kv_allocator`` is not registered.
    """
    from framework import registry

    release = registry.get_class("kv_allocator", kv_allocator).supports_kv_cache_groups
    return KVCacheLayout(make_kv_cache_groups(layers, release), len(layers))
