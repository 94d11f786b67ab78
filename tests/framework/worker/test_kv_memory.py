"""``zeros_on_demand``: the KV cache's CPU storage reads as zeros everywhere, is writable in every KV
dtype, outlives the names that made it, and commits memory only for the pages written."""

from __future__ import annotations

import gc

import pytest
import torch

from framework.worker.kv_memory import zeros_on_demand


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn])
def test_zero_filled_writable_and_shaped_in_every_kv_dtype(dtype):
    t = zeros_on_demand((2, 3, 4, 40), dtype)
    assert t.shape == (2, 3, 4, 40) and t.dtype == dtype and t.is_contiguous()
    assert not t.view(torch.uint8).any()
    t[1, 2, 3, 39] = 1
    assert t.view(torch.uint8).count_nonzero() > 0 and float(t[1, 2, 3, 39].float()) == 1.0
    gc.collect()  # the tensor alone keeps the map alive
    assert float(t.float().sum()) == 1.0


def test_empty_shapes_and_other_devices_fall_back_to_torch_zeros():
    assert zeros_on_demand((0, 4), torch.float32).shape == (0, 4)
    if torch.cuda.is_available():
        assert zeros_on_demand((2,), torch.float32, "cuda").is_cuda


def test_memory_is_committed_only_for_the_pages_written():
    """A 256 MiB cache: allocating it commits (almost) nothing; writing one slot commits a page, not the cache."""
    before = _rss_bytes()
    t = zeros_on_demand((64, 1 << 20), torch.float32)
    t[17, 5] = 3.0
    assert _rss_bytes() - before < (32 << 20), "the whole cache became resident at allocation"
    assert float(t[17, 5]) == 3.0 and float(t[63, -1]) == 0.0
