"""Conformance suites for plugin packages; see :mod:`framework.testing` and docs/plugins.md."""

from framework.testing import (  # noqa: F401
    check_attention_backend,
    check_kv_allocator,
    check_kv_connector,
    check_kv_connector_engine,
    check_lora_backend,
    check_router,
    check_scheduler_policy,
)
from framework.testing.scheduler_policy import check_policy_contract  # noqa: F401
from framework.testing.shadow_cache import check_against_shadow_cache  # noqa: F401
