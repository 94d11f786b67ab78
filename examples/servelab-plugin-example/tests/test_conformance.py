"""The example package runs servelab's conformance suites on its own plugins."""

import os

from servelab_plugin_example.plugin import DenseLoRA, LIFOPolicy, PeakPagedKVAllocator

from servelab.testing import check_kv_allocator, check_lora_backend, check_scheduler_policy

MODEL = os.environ.get("SERVELAB_TEST_MODEL")  # e.g. <servelab checkout>/models/stories260K


def test_lifo_scheduler_policy_contract():
    check_scheduler_policy(LIFOPolicy, model=MODEL)


def test_peak_paged_allocator_invariants():
    check_kv_allocator(PeakPagedKVAllocator)


def test_dense_lora_backend_contract():
    check_lora_backend(DenseLoRA)
