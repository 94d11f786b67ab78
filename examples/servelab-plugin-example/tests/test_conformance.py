"""The example package runs servelab's conformance suites on its own plugins."""

import os

import pytest
import torch
from servelab_plugin_example.memory_connector import MemoryConnector
from servelab_plugin_example.plugin import DenseLoRA, LIFOPolicy, PeakPagedKVAllocator

from plugins.attention.torch_paged import TorchPagedAttentionBackend
from servelab.testing import (
    check_kv_allocator,
    check_kv_connector,
    check_kv_connector_engine,
    check_lora_backend,
    check_scheduler_policy,
)

MODEL = os.environ.get("SERVELAB_TEST_MODEL")  # e.g. <servelab checkout>/models/stories260K


def test_lifo_scheduler_policy_contract():
    check_scheduler_policy(LIFOPolicy, model=MODEL)


def test_peak_paged_allocator_invariants():
    check_kv_allocator(PeakPagedKVAllocator)


def test_dense_lora_backend_contract():
    check_lora_backend(DenseLoRA)


@pytest.mark.parametrize("tp_size", [1, 2])  # 2: one worker side per tensor-parallel rank, each over its own shard
def test_memory_kv_connector_contract(tp_size):
    backend = TorchPagedAttentionBackend(num_heads=4, num_kv_heads=2, head_size=8, scale=8 ** -0.5, block_size=4,
                                         dtype=torch.float32, device=torch.device("cpu"),
                                         compile=False)  # the connector's contract, not the kernel: no compile
    MemoryConnector.store.clear()
    check_kv_connector(MemoryConnector, backend, tp_size=tp_size)


@pytest.mark.skipif(MODEL is None, reason="set SERVELAB_TEST_MODEL to a servelab checkout's models/stories260K")
def test_memory_kv_connector_on_engines():
    """A producer engine then a consumer engine in this process (one rank each: the dict is this process's)."""
    MemoryConnector.store.clear()
    check_kv_connector_engine("memory", MODEL)
