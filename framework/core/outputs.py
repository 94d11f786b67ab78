"""Boundary dataclasses between engine parts: scheduler -> runner -> scheduler -> caller."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from framework.core.request import Request


@dataclass
class SchedulerOutput:
    """What one engine step computes; built by ``Scheduler.schedule()``, read by the model runner.

    Requests appear in ``scheduled_requests`` in the scheduler's order; the runner may reorder
    them inside its batch (e.g. decodes first) but reports results by request id.
    """

    scheduled_requests: list[Request]  # requests with >= 1 token to compute this step
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step (>= 1)
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens; <= max_num_batched_tokens
    # request_id -> its block table of each KV cache group (allocator's lists, read-only); one table for
    # models without sliding windows; released entries of a sliding group hold the allocator's null block
    block_ids: dict[str, tuple[list[int], ...]]
    preempted_req_ids: set[str] = field(default_factory=set)  # preempted (recompute) in this step
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the previous step
    # swap preemption: block copies the runner makes before the forward, all outs before all ins
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (device blocks, swap slots)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (swap slots, device blocks)
    # request_id -> the draft tokens among its scheduled tokens (the last len(...) of them); only
    # requests that verify drafts this step have an entry (speculative decoding)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> each scheduled draft's parent index (-1: the last real token) when its drafts are a tree
    # (framework/core/spec_tree.py); requests whose drafts are a chain have no entry
    scheduled_spec_decode_parents: dict[str, list[int]] = field(default_factory=dict)
    # what the KV connector's worker side loads and saves this step (kv_connector; None: no connector)
    kv_connector_metadata: KVConnectorMetadata | None = None
    # structured output, filled by the engine after schedule() (vLLM's grammar_bitmask): one
    # (num_rows, ceil(vocab / 32)) int32 row per sampled position (k + 1 for a request verifying k
    # drafts) of each constrained request that samples this step; None when there is none
    grammar_bitmask: np.ndarray | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)  # request_id -> first bitmask row

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled and nothing is swapped (the runner is not called)."""
        return self.total_num_scheduled_tokens == 0 and not self.swap_out and not self.swap_in

    @property
    def reaches_workers(self) -> bool:
        """True when the step must go to the workers: it schedules or swaps something, or it carries finished or
        preempted ids (the ranks drop or re-table those requests)."""
        return not self.is_empty or bool(self.finished_req_ids or self.preempted_req_ids)


@dataclass
class ModelRunnerOutput:
    """What one forward produced, built by ``ModelRunner.execute_model`` on the driver rank (the
    only rank that samples) and returned to the engine by the executor.

    A request that only advanced a prefill chunk (did not reach the end of its tokens) has no
    entry in ``sampled_token_ids``.
    """

    sampled_token_ids: dict[str, list[int]]  # request_id -> new tokens (1 without spec decode)
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # per new token: id -> logprob
    prepare_s: float = 0.0  # input preparation time, seconds
    forward_s: float = 0.0  # model forward time, seconds
    sample_s: float = 0.0  # logits processing + sampling time, seconds
    # request_id -> draft tokens accepted this step (speculative decoding; <= its scheduled drafts); with a draft
    # tree, the accepted path's length (its K/V already moved to the positions after the root)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    # the KV connector's worker-side report (finished transfers, blocks that failed to load); None: no connector
    kv_connector_output: KVConnectorOutput | None = None
    # the target's last hidden states of every scheduled token; only when a drafter asks (EAGLE)
    hidden_states: TargetHiddenStates | None = None
    # request_id -> (what failed, "Type: message"): a per-request site of the driver rank's runner raised
    # (grammar bitmask, sampler, rejection sampler); the request has no token here, the engine aborts it
    request_errors: dict[str, tuple[str, str]] = field(default_factory=dict)
    # request_id -> (index of the first prompt token covered, its logprobs and those of the next prompt tokens
    # computed this step): requests with sampling_params.prompt_logprobs whose prefill chunk ran this step
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


class KVConnectorMetadata:
    """What a KV connector's scheduler side tells its worker side for one step
    (``KVConnector.build_connector_meta``; vLLM's ``KVConnectorMetadata``); a connector subclasses it with plain
    values (it travels in the step message to every rank)."""


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker side reports after a step (vLLM's ``KVConnectorOutput``); the driver rank's
    goes to the scheduler (``KVConnector.update_connector_output``, load failures)."""

    finished_sending: set[str] | None = None  # requests whose asynchronous save/send completed
    finished_recving: set[str] | None = None  # requests whose asynchronous load completed
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose K/V failed to load this step
    # what the worker side's store gained or lost this step (connector-defined plain values, e.g. offload's
    # ("stored", key) / ("removed", key)), for its scheduler side (vLLM's kv_cache_events); None: nothing
    kv_cache_events: list[Any] | None = None
    # transfers the worker side finished this step, one (bytes, seconds) each (vLLM's kv_connector_stats); None: none
    kv_connector_stats: list[tuple[int, float]] | None = None
    # why some invalid_block_ids failed, block id -> a message naming the fix (KVConnector.get_load_error_reasons);
    # it reaches the error of a request failed under kv_transfer.load_failure_policy=fail. None: no reasons given
    load_error_reasons: dict[int, str] | None = None


def merge_load_error_reasons(reasons: Sequence[dict[int, str] | None]) -> dict[int, str] | None:
    """The union of several reports' ``load_error_reasons`` (ranks in rank order, or ``multi``'s connectors in
    list order), the first report's reason of a block winning; None when none gives a reason."""
    merged: dict[int, str] = {}
    for report in reasons:
        for block, why in (report or {}).items():
            merged.setdefault(block, why)
    return merged or None


@dataclass
class TargetHiddenStates:
    """The target's last hidden states (after its final norm: the LM head's input) of one forward.

    Token ``t`` of request ``i`` (batch order) is row ``query_start_loc[i] + t`` and sits at
    position ``context_lens[i] + t``. Rows of draft tokens that verification rejected are included;
    the reader keeps only positions below the request's ``num_computed_tokens`` after the step.
    """

    request_ids: list[str]  # batch order
    query_start_loc: np.ndarray  # (num_reqs + 1,) int64: first row of each request
    context_lens: np.ndarray  # (num_reqs,) int64: position of each request's first scheduled token
    hidden_states: torch.Tensor  # (num_tokens, hidden_size), model dtype, on the model's device


@dataclass
class RequestMetrics:
    """Latency metrics of one finished request, seconds (vLLM / SGLang benchmark definitions)."""

    ttft_s: float | None  # time to first token: first token - arrival
    tpot_s: float | None  # time per output token after the first: (finish - first) / (n_out - 1)
    itl_s: list[float]  # inter-token latencies between consecutive output tokens
    e2e_s: float | None  # end-to-end latency: finish - arrival
    queue_s: float | None  # waiting time: first scheduled - arrival
    num_prompt_tokens: int  # prompt length, tokens
    num_output_tokens: int  # generated tokens
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    num_preemptions: int  # times the request was preempted
    # KV blocks the request held per KV cache group at its last step (its whole context in cache; with
    # sliding windows only the windows' blocks); shared prefix blocks count for each owner
    kv_blocks: list[int] = field(default_factory=list)
    kv_bytes: int = 0  # bytes of those blocks (blocks * bytes per block: every layer of a block, K and V)
    peak_kv_bytes: int = 0  # bytes of the most blocks it held at once (a prefill chunk's window + chunk)

    def as_dict(self) -> dict[str, object]:
        """Plain-dict form for JSON writers."""
        return dict(self.__dict__)


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``)."""

    index: int  # completion index among the request's n (0 .. n - 1)
    text: str  # detokenized output; stop string trimmed unless include_stop_str_in_output
    token_ids: list[int]  # (num_output_tokens,) sampled ids, including a final EOS/stop id
    finish_reason: str | None  # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] | None = None  # per output token: top-N ids -> logprob


@dataclass
class RequestOutput:
    """A request's state as reported to the caller (vLLM's ``RequestOutput``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # set once finished (n > 1: the metrics of sequence 0)
    error: str | None = None  # set when the request was rejected (e.g. prompt too long) or failed (finish "abort")
    # True when ``error`` is a fault of the server (a plugin or the detokenizer raised on this request; HTTP 500),
    # False for a rejection of the request itself (HTTP 400)
    internal_error: bool = False
    # per prompt token (sampling_params.prompt_logprobs): None for the first, then top-N ids + the prompt token ->
    # logprob; None when not asked (DELTA outputs carry it once, with the first tokens)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens served from the prefix cache, summed over the request's n sequences (set once finished)
    num_cached_tokens: int | None = None
    # what the KV connector's request_finished returned (vLLM's kv_transfer_params; set once finished, else None)
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class SchedulerStats:
    """Per-step statistics passed to the ``on_step_end`` lifecycle hook."""

    step: int  # engine step counter, from 0
    num_running_reqs: int  # requests holding KV blocks after scheduling
    num_waiting_reqs: int  # requests queued (incl. preempted)
    num_scheduled_tokens: int  # tokens computed this step (prefill + decode)
    num_prefill_tokens: int  # of which belong to requests still in prefill (chunks)
    num_decode_tokens: int  # of which are single-token decodes
    kv_cache_usage: float  # fraction of KV blocks in use, [0, 1]
    prefix_cache_hit_rate: float  # cumulative hit tokens / queried tokens, [0, 1]
    num_preemptions: int  # preemptions in this step
    schedule_s: float = 0.0  # time in Scheduler.schedule, seconds
    prepare_s: float = 0.0  # runner input preparation, seconds
    forward_s: float = 0.0  # model forward, seconds
    sample_s: float = 0.0  # sampling, seconds
    update_s: float = 0.0  # Scheduler.update_from_output, seconds
    step_s: float = 0.0  # whole step, seconds
    num_generated_tokens: int = 0  # output tokens produced this step
    kv_cache_fragmentation: float = 0.0  # allocated but unused token slots / allocated slots, [0, 1]
    num_preemptions_swap: int = 0  # of num_preemptions, those that swapped out (the rest recompute)
    num_swap_out_blocks: int = 0  # KV blocks copied device -> swap space this step (swap preemption)
    num_swap_in_blocks: int = 0  # KV blocks copied swap space -> device this step
    swapped_bytes: int = 0  # bytes moved by this step's swaps (both directions)
    # KV connector (vLLM's names), cumulative tokens: prompt tokens of the requests admitted while asking it, and of
    # which it supplied; 0 without a connector
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # KV connector transfers (pulls, loads) finished since the previous stats: how many, their bytes and their summed
    # wall time, seconds; 0 without a connector
    num_kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    num_sampled_reqs: int = 0  # requests that got >= 1 token this step
    num_spec_reqs: int = 0  # requests that verified drafts this step (speculative decoding)
    num_draft_tokens: int = 0  # draft tokens verified this step
    num_accepted_tokens: int = 0  # of which the target accepted
    draft_s: float = 0.0  # drafter time after this step (proposing the next drafts), seconds

    def as_dict(self) -> dict[str, float | int]:
        """Plain-dict form for trackers."""
        return dict(self.__dict__)
