"""KV cache groups (``framework/core/kv_cache_groups.py``): which layers share a block table and a KV tensor,
for the real layer patterns of Gemma 3, Gemma 2 / gpt-oss, Mistral and Llama."""

from __future__ import annotations

import pytest

from framework.core.kv_cache_groups import KVCacheLayout, make_kv_cache_groups
from framework.interfaces import AttentionLayerSpec, KVCacheGroup


def layers(windows: list[int | None]) -> list[AttentionLayerSpec]:
    return [AttentionLayerSpec(4, 1, 16, 16, sliding_window=w) for w in windows]


def gemma3(num_layers: int, window: int = 512) -> list[int | None]:
    """Gemma 3's pattern: every sixth layer full (``sliding_window_pattern=6``), the rest windowed."""
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_1b_groups_four_layers_per_block():
    """26 layers, 4 full: one full group and six sliding groups of (up to) 4 layers, as vLLM groups them."""
    layout = KVCacheLayout(make_kv_cache_groups(layers(gemma3(26)), release_sliding_blocks=True), 26)
    assert layout.layers_per_block == 4
    assert [g.sliding_window for g in layout.groups] == [None] + [512] * 6
    assert layout.groups[0].layer_ids == (5, 11, 17, 23)
    assert [len(g.layer_ids) for g in layout.groups] == [4, 4, 4, 4, 4, 4, 2]
    assert layout.has_null_block
    tensor, group = layout.tensor_of_layer(), layout.group_of_layer()
    assert (tensor[5], group[5], tensor[0], group[0], tensor[25], group[25]) == (0, 0, 0, 1, 1, 6)
    # an 8k request with 16-token blocks and 512-token chunks: 512 full blocks + 6 x 65 window blocks
    assert layout.max_blocks_per_request(8192, 16, 512) == 512 + 6 * (-(-(511 + 512) // 16) + 1)


def test_gemma3_270m_and_alternating_models():
    layout = KVCacheLayout(make_kv_cache_groups(layers(gemma3(18)), True), 18)
    assert layout.layers_per_block == 3 and len(layout.groups) == 6
    alternating = [128 if i % 2 == 0 else None for i in range(24)]  # gpt-oss / Gemma 2
    groups = make_kv_cache_groups(layers(alternating), True)
    assert [(len(g.layer_ids), g.sliding_window) for g in groups] == [(12, None), (12, 128)]
    near = [None] * 9 + [64] * 11  # 11 < 1.25 * 9: one group per type, the smaller padded
    assert [len(g.layer_ids) for g in make_kv_cache_groups(layers(near), True)] == [9, 11]


@pytest.mark.parametrize(("windows", "release", "expected"), [
    ([None] * 4, True, [((0, 1, 2, 3), None)]),  # Llama
    ([7] * 4, True, [((0, 1, 2, 3), 7)]),  # Mistral: one windowed group, blocks released
    ([7, None, 7, None], False, [((0, 1, 2, 3), None)]),  # an allocator without groups: full tables
    ([None, 7, 5], True, [((0,), None), ((2,), 5), ((1,), 7)]),  # two windows, ascending
])
def test_single_type_and_fallback(windows, release, expected):
    groups = make_kv_cache_groups(layers(windows), release)
    assert [(g.layer_ids, g.sliding_window) for g in groups] == expected


def test_layout_rejects_a_layer_in_two_groups():
    with pytest.raises(ValueError, match="cover each"):
        KVCacheLayout((KVCacheGroup((0, 1)), KVCacheGroup((1,), 4)), 2)


def test_window_rules():
    """Skipped blocks: wholly before ``num_computed - W + 1``; a hit needs ``ceil((W - 1) / block_size)`` blocks."""
    group = KVCacheGroup((0,), sliding_window=7)
    assert [group.num_skipped_blocks(n, 4) for n in (0, 6, 10, 11, 14, 15)] == [0, 0, 1, 1, 2, 2]
    assert group.num_hit_window_blocks(4) == 2 and KVCacheGroup((0,), 1).num_hit_window_blocks(4) == 0
    assert KVCacheGroup((0,)).num_skipped_blocks(100, 4) == 0 and KVCacheGroup((0,)).num_hit_window_blocks(4) is None
