"""Conformance suites a plugin package runs in its own pytest (importable as ``servelab.testing``).

    from servelab.testing import check_scheduler_policy, check_kv_allocator
    def test_my_policy(): check_scheduler_policy(MyPolicy, model="path/to/stories260K")

Each ``check_*`` raises ``AssertionError`` naming the broken contract; see docs/plugins.md.
"""

from framework.testing.kv_allocator import check_kv_allocator
from framework.testing.scheduler_policy import check_scheduler_policy

__all__ = ["check_kv_allocator", "check_scheduler_policy"]
