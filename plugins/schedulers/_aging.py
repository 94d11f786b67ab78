"""The aging bound two policies share (``sjf``, ``lora_affinity``): a request that has waited at least ``aging_s``
seconds since its arrival outranks every younger one, first come first served among the aged, so no order the
policy prefers can starve it (the classic aging remedy for SJF starvation; cf. Fu et al. 2024, Sec. 2)."""

from __future__ import annotations

import time
from collections.abc import Callable

from framework.core.request import Request
from framework.interfaces import SchedulerPolicy


class AgingPolicy(SchedulerPolicy):
    """A policy with an aging bound: :meth:`aged` says whether a request has waited ``aging_s`` seconds.

    Args:
        aging_s: waiting time after which a request outranks all non-aged ones, seconds
            (``scheduler.params.aging_s``; ``inf`` disables aging).
        clock: time source on the requests' ``arrival_time`` clock (``time.perf_counter``); injectable for
            tests; an engine hands its own (``use_clock``: wall or simulated time).

    Raises:
        ValueError: ``aging_s <= 0``.
    """

    def __init__(self, aging_s: float = 10.0, clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        if not aging_s > 0:
            raise ValueError(f"scheduler.params.aging_s must be > 0 seconds, got {aging_s}")
        self.aging_s = float(aging_s)
        self.clock = clock

    def aged(self, request: Request, now: float | None = None) -> bool:
        """Whether ``request`` has waited at least ``aging_s`` seconds since its arrival (``now``: a clock reading
        to use instead of reading the clock, seconds)."""
        return (self.clock() if now is None else now) - request.arrival_time >= self.aging_s
