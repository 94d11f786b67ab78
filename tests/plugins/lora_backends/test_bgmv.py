"""``lora_backend=bgmv``: the LoRA backend contract (framework/testing/lora_backend.py) and the registry key."""

from __future__ import annotations

import pytest

from framework import registry
from framework.testing import check_lora_backend
from plugins.lora_backends.bgmv import BGMVBackend


def test_registered_as_bgmv():
    assert registry.get_class("lora_backend", "bgmv") is BGMVBackend


@pytest.mark.parametrize("seed", [0, 1])
def test_bgmv_passes_the_lora_backend_contract(seed):
    check_lora_backend(BGMVBackend, seed=seed)
