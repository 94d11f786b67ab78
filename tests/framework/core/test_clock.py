"""The engine's clock: wall time sleeps, virtual time moves only when told."""

from __future__ import annotations

import time

import pytest

from framework.core.clock import WALL_CLOCK, VirtualClock


def test_virtual_clock_moves_only_by_advance_and_sleep():
    clock = VirtualClock(start_s=10.0)
    assert clock.now() == 10.0 and not clock.realtime
    clock.advance(0.25)
    assert clock.now() == 10.25
    clock.sleep_until(12.0)  # idle until an arrival: a jump, no wall time
    assert clock.now() == 12.0
    clock.sleep_until(11.0)  # in the past: no move backwards
    assert clock.now() == 12.0


@pytest.mark.parametrize("bad", [-1e-9, float("inf"), float("nan")])
def test_virtual_clock_refuses_bad_durations(bad):
    with pytest.raises(ValueError, match="finite duration"):
        VirtualClock().advance(bad)


def test_wall_clock_sleeps_until():
    start = WALL_CLOCK.now()
    WALL_CLOCK.sleep_until(start + 0.05)
    assert WALL_CLOCK.now() - start >= 0.05 and WALL_CLOCK.realtime
    before = time.perf_counter()
    WALL_CLOCK.sleep_until(start)  # already past: returns at once
    assert time.perf_counter() - before < 0.05
