"""The requests of batches in flight (vLLM V1's batch queue, pipeline parallelism; its ``scheduled_req_ids``).

:meth:`framework.core.scheduler.Scheduler.schedule` records the requests it scheduled as in flight until
:meth:`~framework.core.scheduler.Scheduler.update_from_output` applies that batch; a later ``schedule()`` skips them
(their tokens are not known yet), never preempts them (their K/V is being written), and ``max_num_seqs`` caps the
requests of one batch, not those in flight (vLLM V0 kept one scheduler, so one ``max_num_seqs``, per pipeline stage).
When the policy's victim for a request that needs blocks (or for the waiting head) has a step in flight, that
request waits a step and nothing is admitted, until the batch is back and the victim may go: evicting a higher-ranked
request in its place thrashed (requests preempted in turn, none finishing: the shadow cache with two batches in flight,
``tests/framework/core/test_shadow_cache.py``).
With one batch at a time (schedule, update, schedule...) nothing is ever in flight at ``schedule()`` and all of this
is a no-op.
"""

from __future__ import annotations

from framework.core.request import Request


class InFlight(set):
    """Request ids scheduled in a batch whose output has not been applied yet (a ``set`` of ``str``)."""

    def num_schedulable(self, running: list[Request]) -> int:
        """Running requests this batch may schedule (those with no step in flight): what ``max_num_seqs`` caps."""
        return sum(r.request_id not in self for r in running) if self else len(running)
