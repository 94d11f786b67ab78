"""The requests of batches in flight (vLLM V1's batch queue, pipeline parallelism; its ``scheduled_req_ids``).

:meth:`framework.core.scheduler.Scheduler.schedule` records the requests it scheduled as in flight until
:meth:`~framework.core.scheduler.Scheduler.update_from_output` applies that batch; a later ``schedule()`` skips them
(their tokens are not known yet), never preempts them (their K/V is being written), and ``max_num_seqs`` caps the
requests of one batch, not those in flight (vLLM V0 kept one scheduler, so one ``max_num_seqs``, per pipeline stage).
With one batch at a time (schedule, update, schedule...) nothing is ever in flight at ``schedule()`` and all of this
is a no-op.
"""

from __future__ import annotations

from framework.core.request import Request


class InFlight(set):
    """Request ids scheduled in a batch whose output has not been applied yet (a ``set`` of ``str``)."""

    def preemptible(self, running: list[Request]) -> list[Request]:
        """Running requests with no step in flight: the only ones a preemption may evict (an in-flight one's
        output would come back for blocks already given away)."""
        return [r for r in running if r.request_id not in self] if self else running

    def num_schedulable(self, running: list[Request]) -> int:
        """Running requests this batch may schedule (those with no step in flight): what ``max_num_seqs`` caps."""
        return sum(r.request_id not in self for r in running) if self else len(running)
