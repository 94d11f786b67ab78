"""Conformance suites a plugin package runs in its own pytest (importable as ``servelab.testing``).

    from servelab.testing import check_attention_backend, check_kv_allocator, check_router, check_scheduler_policy
    from servelab.testing import check_lora_backend  # def test_my_backend(): check_lora_backend(MyLoRABackend)
    from servelab.testing import check_kv_connector  # check_kv_connector(MyConnector, backend, path=tmp_path)
    from servelab.testing import check_kv_connector_engine  # ("my_connector", model, executor="mp", tensor_parallel_size=2)
    def test_my_policy(): check_scheduler_policy(MyPolicy, model="path/to/stories260K")

Each ``check_*`` raises ``AssertionError`` naming the broken contract; see docs/plugins.md. The
model-free KV oracle is ``framework.testing.shadow_cache`` (``check_against_shadow_cache``).
"""

from framework.testing.attention import check_attention_backend
from framework.testing.kv_allocator import check_kv_allocator
from framework.testing.kv_connector import check_kv_connector
from framework.testing.kv_connector_engine import check_kv_connector_engine
from framework.testing.lora_backend import check_lora_backend
from framework.testing.router import check_router
from framework.testing.scheduler_policy import check_scheduler_policy

__all__ = ["check_attention_backend", "check_kv_allocator", "check_kv_connector", "check_kv_connector_engine",
           "check_lora_backend", "check_router", "check_scheduler_policy"]
