"""``lora_backend=loop``: the LoRA backend contract (framework/testing/lora_backend.py) and the registry key."""

from __future__ import annotations

import pytest

from framework import registry
from framework.testing import check_lora_backend
from plugins.lora_backends.loop import LoopBackend


def test_registered_as_loop():
    assert registry.get_class("lora_backend", "loop") is LoopBackend


@pytest.mark.parametrize("seed", [0, 1])
def test_loop_passes_the_lora_backend_contract(seed):
    check_lora_backend(LoopBackend, seed=seed)
