"""servelab.testing conformance suites pass on the built-ins and catch broken plugins."""

from __future__ import annotations

import pytest
from helpers import STORIES

from plugins.attention.torch import TorchAttentionBackend
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy
from plugins.schedulers.priority import PriorityPolicy
from servelab.testing import check_attention_backend, check_kv_allocator, check_policy_contract, check_scheduler_policy


def test_builtin_policies_pass_the_contract():
    check_policy_contract(FCFSPolicy)
    check_policy_contract(PriorityPolicy)


def test_priority_passes_the_engine_run_under_kv_pressure():
    check_scheduler_policy(PriorityPolicy, model=STORIES)


def test_paged_allocator_passes_the_invariants():
    check_kv_allocator(PagedKVAllocator)


def test_a_mutating_key_is_caught():
    class Mutating(FCFSPolicy):
        name = "mutating"

        def key(self, request):
            request.priority += 1
            return (request.priority,)

    with pytest.raises(AssertionError, match="must not mutate|deterministic"):
        check_policy_contract(Mutating)


def test_a_leaking_allocator_is_caught():
    class Leaky(PagedKVAllocator):
        name = "leaky"

        def free(self, request):  # forgets to release anything
            return None

    with pytest.raises(AssertionError):
        check_kv_allocator(Leaky)


@pytest.mark.parametrize("decode_kernel", TorchAttentionBackend.DECODE_KERNELS)
@pytest.mark.parametrize("prefill_kernel", TorchAttentionBackend.PREFILL_KERNELS)
def test_torch_attention_passes_the_reference_check(decode_kernel, prefill_kernel):
    check_attention_backend(TorchAttentionBackend, decode_kernel=decode_kernel, prefill_kernel=prefill_kernel)


def test_a_wrong_backend_is_caught():
    class NoScale(TorchAttentionBackend):
        name = "noscale"

        def forward(self, layer_idx, query, key, value, kv_cache, metadata):
            return super().forward(layer_idx, query * 2.0, key, value, kv_cache, metadata)

    with pytest.raises(AssertionError, match="reference"):
        check_attention_backend(NoScale)
