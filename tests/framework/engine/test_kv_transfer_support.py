"""What ``kv_connector`` refuses before weights load (``framework/engine/kv_transfer_support.py``), each problem
naming the fix, and the scheduler side it builds."""

from __future__ import annotations

import pytest

from framework.config import EngineConfig
from framework.engine.kv_transfer_support import kv_transfer_problems, make_kv_transfer


def _config(path: str = "kv", **kwargs) -> EngineConfig:
    return EngineConfig(model="models/stories260K", kv_connector="shared_storage", kv_connector_params={"path": path},
                        **kwargs)


def test_none_is_always_fine_and_builds_nothing():
    config = EngineConfig(model="m", tensor_parallel_size=2)
    assert kv_transfer_problems(config) == [] and make_kv_transfer(config) is None


@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"tensor_parallel_size": 2, "executor": "uniproc"}, "use executor=mp or executor=ray"),
    ({"executor": "sim"}, "executor=uniproc"),
    ({"kv_allocator": "radix"}, "kv_cache=paged"),
    ({"kv_cache_dtype": "int8"}, "engine.kv_cache_dtype=auto"),
])
def test_unsupported_combinations_are_refused_naming_the_fix(kwargs, fix):
    problems = kv_transfer_problems(_config(**kwargs))
    assert len(problems) >= 1 and any(fix in p for p in problems)


def test_config_checks_role_and_policy(tmp_path):
    with pytest.raises(ValueError, match="kv_transfer.role"):
        _config(kv_role="sender")
    with pytest.raises(ValueError, match="load_failure_policy"):
        _config(kv_load_failure_policy="retry")
    transfer = make_kv_transfer(_config(str(tmp_path), kv_role="kv_consumer", kv_load_failure_policy="fail"))
    assert transfer.load_failure_policy == "fail" and transfer.connector.is_consumer
    assert not transfer.connector.is_producer
