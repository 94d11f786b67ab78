"""``lora_backend=sgmv``: the LoRA backend contract (framework/testing/lora_backend.py) and the registry key."""

from __future__ import annotations

import pytest

from framework import registry
from framework.testing import check_lora_backend
from plugins.lora_backends.sgmv import SGMVBackend


def test_registered_as_sgmv():
    assert registry.get_class("lora_backend", "sgmv") is SGMVBackend


@pytest.mark.parametrize("seed", [0, 1])
def test_sgmv_passes_the_lora_backend_contract(seed):
    check_lora_backend(SGMVBackend, seed=seed)
