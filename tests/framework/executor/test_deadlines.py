"""The executor's deadlines (issue 44): the step deadline follows the measured step times, scaled by the
step's tokens and clamped to its floor and ceiling; the compile warm-up has its own; bad bounds are refused."""

from __future__ import annotations

import pytest

from framework.executor.deadlines import Deadlines, StepDeadline


def test_step_deadline_follows_measured_step_times():
    d = Deadlines(execute_timeout_s=300, min_step_deadline_s=5, step_deadline_factor=8)
    step = StepDeadline(d)
    assert step.deadline_s(64) == 300  # nothing measured yet: the ceiling
    step.observe(5, 1.5)  # the first step pays one-off initialisation: not kept
    assert step.deadline_s(64) == 300
    step.observe(64, 0.05)  # a batch-64 decode, 50 ms
    assert step.deadline_s(64) == 5  # 8 x 50 ms is below the floor
    step.observe(2048, 2.0)  # a full prefill chunk, 2 s
    assert step.deadline_s(64) == pytest.approx(16.0)  # the slowest recent step, never scaled down
    assert step.deadline_s(8192) == pytest.approx(8 * 2.0 * 4)  # scaled up by tokens: 64 s
    assert step.deadline_s(10**6) == 300  # the ceiling


def test_deadlines_per_call_and_their_validation():
    d, rest = Deadlines.from_params({"compile_timeout_s": 900, "chunk_bytes": 64, "rpc_timeout_s": 30})
    assert rest == {"chunk_bytes": 64} and d.compile_timeout_s == 900
    assert d.for_call("compile_decoder", compile_at_start=False) == 900
    assert d.for_call("initialize_cache", compile_at_start=True) == 900  # the warm-up runs there
    assert d.for_call("initialize_cache", compile_at_start=False) == 30
    assert d.for_call(print, compile_at_start=False) == 30  # a callable
    with pytest.raises(ValueError, match="heartbeat_timeout_s must be a positive number"):
        Deadlines.from_params({"heartbeat_timeout_s": 0})
