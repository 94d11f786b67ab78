"""Output shaping (vLLM V1's ``OutputProcessor``, ``vllm/v1/engine/output_processor.py``): a request after a step
becomes the caller's :class:`~framework.core.outputs.RequestOutput`, and a step becomes its
:class:`~framework.core.outputs.SchedulerStats` (what ``on_step_end`` hooks and the metrics see).

``output_kind``: ``CUMULATIVE`` copies text/tokens so far; ``DELTA`` gives only what is new since the request's
previous output (no full-list copy); ``FINAL_ONLY`` gives nothing until finished. While running, the last
``len(longest stop string) - 1`` characters are held back, so a stop string that spans two steps never reaches a
stream before it is trimmed.
"""

from __future__ import annotations

from typing import Any

from framework import registry
from framework.core.outputs import CompletionOutput, ModelRunnerOutput, RequestOutput, SchedulerStats
from framework.core.request import Request
from framework.core.sampling_params import RequestOutputKind
from framework.core.scheduler import Scheduler
from framework.core.spec_tree import tree_depths
from framework.metrics.collector import MetricsCollector, compute_request_metrics


class OutputProcessor:
    """Shapes each request's outputs and reports finished requests and steps to the metrics and the
    ``on_request_finished`` / ``on_step_end`` hooks (see the module docstring).

    Args:
        block_bytes: bytes of one KV block over all ranks (a finished request's KV metrics).
        metrics: the run's collector.
    """

    def __init__(self, block_bytes: int, metrics: MetricsCollector) -> None:
        self.block_bytes = block_bytes
        self.metrics = metrics
        self._sent: dict[str, tuple[int, int]] = {}  # DELTA requests: (chars, tokens) already reported

    def make_output(self, request: Request) -> RequestOutput | None:
        """The caller's view of ``request`` now, shaped by ``sampling_params.output_kind`` (``None``: nothing
        to report, a ``FINAL_ONLY`` request still running)."""
        params = request.sampling_params
        finished = request.is_finished
        kind = params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text = request.output_text
        if not finished and params.stop and not params.include_stop_str_in_output:
            text = text[:max(0, len(text) - (max(len(s) for s in params.stop) - 1))]
        token_ids, logprobs = request.output_token_ids, request.logprobs
        prompt_logprobs = list(request.prompt_logprobs) if params.prompt_logprobs is not None else None
        if kind is RequestOutputKind.DELTA:
            sent_chars, sent_tokens = self._sent.pop(request.request_id, (0, 0))
            if not finished:
                self._sent[request.request_id] = (max(sent_chars, len(text)), len(token_ids))
            text, token_ids, logprobs = text[sent_chars:], token_ids[sent_tokens:], logprobs[sent_tokens:]
            if sent_tokens:  # prompt logprobs go out once, with the first tokens
                prompt_logprobs = None
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(token_ids), finish_reason=request.finish_reason,
            stop_reason=request.stop_reason, logprobs=list(logprobs) if params.logprobs is not None else None)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=finished,
                             metrics=compute_request_metrics(request, self.block_bytes) if finished else None,
                             error=request.error, internal_error=request.internal_error,
                             prompt_logprobs=prompt_logprobs,
                             num_cached_tokens=request.num_cached_tokens if finished else None,
                             kv_transfer_params=request.kv_transfer_params if finished else None)

    def report_finished(self, request: Request) -> RequestOutput:
        """The final output of a finished ``request``, observed (:meth:`observe_finished`)."""
        output = self.make_output(request)
        self.observe_finished(output)
        return output

    def observe_finished(self, output: RequestOutput) -> None:
        """A finished request's output into the metrics and the ``on_request_finished`` hook."""
        self.metrics.observe_finished(output)
        registry.call_hook("on_request_finished", output=output)

    def observe_step(self, stats: SchedulerStats, sched_out: Any, runner_out: ModelRunnerOutput) -> None:
        """A step's stats (:func:`scheduler_stats`) into the metrics and the ``on_step_end`` hook."""
        self.metrics.observe_step(stats)
        if sched_out.scheduled_spec_decode_tokens:  # a draft tree counts by depth: one position per level
            levels = {rid: [0] * int(tree_depths(parents).max())
                      for rid, parents in getattr(sched_out, "scheduled_spec_decode_parents", {}).items()}
            self.metrics.observe_draft_positions({**sched_out.scheduled_spec_decode_tokens, **levels},
                                                 runner_out.num_accepted_tokens)
        registry.call_hook("on_step_end", stats=stats)


def scheduler_stats(step: int, scheduler: Scheduler, sched_out: Any, runner_out: ModelRunnerOutput,
                    num_sampled_reqs: int, times: tuple[float, float, float, float], draft_s: float,
                    swap_block_bytes: int) -> SchedulerStats:
    """One step's :class:`SchedulerStats`.

    Args:
        step: the step's index; scheduler: its state after the update (queues, KV usage).
        sched_out: the step's ``SchedulerOutput``; runner_out: what the executor returned.
        num_sampled_reqs: requests that got tokens this step.
        times: clock readings (seconds) at the step's start, after scheduling, after the executor, after the
            update.
        draft_s: seconds the drafter took after the update.
        swap_block_bytes: bytes one swapped KV block moves.
    """
    t0, t1, t2, t3 = times
    n = sched_out.num_scheduled_tokens
    num_decode = sum(1 for v in n.values() if v == 1)
    kv_stats = scheduler.kv.stats()
    transfer = scheduler.kv_transfer
    transfers = transfer.take_transfers() if transfer is not None else []
    return SchedulerStats(
        step=step, num_running_reqs=len(scheduler.running), num_waiting_reqs=scheduler.num_waiting,
        num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
        num_prefill_tokens=sched_out.total_num_scheduled_tokens - num_decode, num_decode_tokens=num_decode,
        kv_cache_usage=kv_stats.usage, kv_cache_fragmentation=kv_stats.fragmentation,
        num_preemptions_swap=len(sched_out.swap_out),
        num_swap_out_blocks=sum(len(b) for b, _ in sched_out.swap_out),
        num_swap_in_blocks=sum(len(b) for _, b in sched_out.swap_in),
        swapped_bytes=swap_block_bytes * sum(len(b) for b, _ in sched_out.swap_out + sched_out.swap_in),
        prefix_cache_hit_rate=kv_stats.hit_rate,
        external_prefix_cache_queries=transfer.external_prefix_cache_queries if transfer is not None else 0,
        external_prefix_cache_hits=transfer.external_prefix_cache_hits if transfer is not None else 0,
        num_kv_transfers=len(transfers), kv_transfer_bytes=sum(b for b, _ in transfers),
        kv_transfer_s=sum(s for _, s in transfers),
        num_preemptions=len(sched_out.preempted_req_ids), schedule_s=t1 - t0,
        prepare_s=runner_out.prepare_s, forward_s=runner_out.forward_s, sample_s=runner_out.sample_s,
        update_s=t3 - t2, step_s=t3 - t0,
        num_generated_tokens=sum(len(v) for v in runner_out.sampled_token_ids.values()),
        num_sampled_reqs=num_sampled_reqs, num_spec_reqs=len(sched_out.scheduled_spec_decode_tokens),
        num_draft_tokens=sum(len(v) for v in sched_out.scheduled_spec_decode_tokens.values()),
        num_accepted_tokens=sum(runner_out.num_accepted_tokens.values()), draft_s=draft_s,
    )
