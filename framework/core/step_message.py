"""The per-step message from the driver to every worker rank (vLLM V1's ``NewRequestData`` /
``CachedRequestData`` split of ``SchedulerOutput``).

The driver keeps the only copy of engine state (scheduler, KV allocator, grammar matchers,
drafters); each worker keeps a mirror of the requests it computes
(:class:`framework.worker.input_batch.InputBatch`). So a step's message carries a request in full
once, the first time it is scheduled, and afterwards only what changed: the tokens appended since
the request's previous message, the blocks appended to its table (the whole table after a
preemption), and its ``num_computed_tokens``. A model with KV cache groups
(``framework/core/kv_cache_groups.py``) has one block table per group; a sliding-window group's
leading entries turn into the null block as they leave the window, which the message carries as one
count per group. A decode step of ``B`` requests is therefore
``O(B)`` small integers, whatever the prompt lengths (see ``docs/decisions/executor.md``).

:class:`StepMessageBuilder` is the driver's half: it remembers, per request, how many tokens and
blocks the workers already hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from framework.core.lora_request import LoRARequest
from framework.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from framework.core.outputs import KVConnectorMetadata, SchedulerOutput


@dataclass
class NewRequestData:
    """A request the workers have not seen: everything they need to compute and sample it."""

    request_id: str
    prompt_token_ids: list[int]  # (num_prompt_tokens,) token ids
    output_token_ids: list[int]  # (num_output_tokens,) tokens already generated (usually empty)
    sampling_params: SamplingParams  # the driver rank samples with it (seed, penalties, min_tokens)
    eos_token_ids: frozenset[int]  # model EOS ids (min_tokens masks them)
    block_ids: tuple[list[int], ...]  # its whole block table per KV cache group, in token order
    num_computed_tokens: int  # tokens whose K/V are already cached (prefix-cache hit), tokens
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model); ranks load it on demand


@dataclass
class CachedRequestData:
    """Requests the workers already hold; parallel lists, one entry per scheduled request."""

    request_ids: list[str] = field(default_factory=list)
    # True: the request was preempted since its previous message; new_block_ids is its whole table
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # appended since its previous message
    # per KV cache group: appended to its table (whole table if resumed)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    # per KV cache group: leading entries now the null block (released out-of-window blocks)
    num_released_blocks: list[tuple[int, ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # the driver's value at schedule time, tokens


@dataclass
class StepMessage:
    """What every worker receives for one step (the step broadcast); built by :class:`StepMessageBuilder`.

    Workers apply ``finished_req_ids`` first, then ``new_reqs``, then ``cached_reqs``.
    """

    new_reqs: list[NewRequestData]  # scheduled for the first time
    cached_reqs: CachedRequestData  # scheduled again: only what changed
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step, in the scheduler's order
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens
    finished_req_ids: set[str]  # finished or aborted since the previous message: workers drop their state
    swap_out: list[tuple[list[int], list[int]]]  # (device blocks, swap slots), copied before the forward
    swap_in: list[tuple[list[int], list[int]]]  # (swap slots, device blocks), after every swap-out
    scheduled_spec_decode_tokens: dict[str, list[int]]  # request_id -> drafts verified this step
    # structured output, computed by the driver (vLLM's SchedulerOutput.grammar_bitmask): one
    # (num_rows, ceil(vocab / 32)) int32 row per sampled position of a constrained request
    grammar_bitmask: np.ndarray | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)  # request_id -> first bitmask row
    kv_connector_metadata: KVConnectorMetadata | None = None  # the KV connector's loads and saves (kv_connector)
    # request_id -> each draft's parent index when its drafts are a tree (framework/core/spec_tree.py)
    scheduled_spec_decode_parents: dict[str, list[int]] = field(default_factory=dict)


class StepMessageBuilder:
    """Driver side of the message protocol: turns each ``SchedulerOutput`` into a :class:`StepMessage`.

    Assumes the KV allocator's contract: a running request's block tables only grow, except that a
    sliding-window group's leading entries may turn into ``null_block`` (never another id), until
    the request is preempted or finishes; a preempted request is re-sent with its whole new tables.

    Args:
        null_block: the null block's id (the pool's ``num_blocks``; set by
            ``Executor.initialize_cache``); ``None`` counts no released entries.
    """

    def __init__(self, null_block: int | None = None) -> None:
        self.null_block = null_block
        self._sent: dict[str, tuple[int, tuple[int, ...]]] = {}  # request_id -> (tokens, blocks per group) held
        self._resumed: set[str] = set()  # preempted since their last message

    def build(self, so: SchedulerOutput) -> StepMessage:
        """The message for ``so``; records what the workers will hold after applying it."""
        for rid in so.finished_req_ids:
            self._sent.pop(rid, None)
            self._resumed.discard(rid)
        self._resumed |= so.preempted_req_ids & self._sent.keys()
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        for request in so.scheduled_requests:
            rid, tables = request.request_id, so.block_ids[request.request_id]
            sent = self._sent.get(rid)
            if sent is None:
                new_reqs.append(NewRequestData(
                    request_id=rid, prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids), sampling_params=request.sampling_params,
                    eos_token_ids=request.eos_token_ids, block_ids=tuple(list(t) for t in tables),
                    num_computed_tokens=request.num_computed_tokens, lora_request=request.lora_request))
            else:
                resumed = rid in self._resumed
                self._resumed.discard(rid)
                cached.request_ids.append(rid)
                cached.resumed_from_preemption.append(resumed)
                cached.new_token_ids.append(request.all_token_ids[sent[0]:])
                cached.new_block_ids.append(tuple(list(t) if resumed else t[n:] for t, n in zip(tables, sent[1])))
                cached.num_released_blocks.append(tuple(self._num_released(t) for t in tables))
                cached.num_computed_tokens.append(request.num_computed_tokens)
            self._sent[rid] = (request.num_tokens, tuple(len(t) for t in tables))
        return StepMessage(
            new_reqs=new_reqs, cached_reqs=cached,
            num_scheduled_tokens={r.request_id: so.num_scheduled_tokens[r.request_id] for r in so.scheduled_requests},
            total_num_scheduled_tokens=so.total_num_scheduled_tokens, finished_req_ids=set(so.finished_req_ids),
            swap_out=so.swap_out, swap_in=so.swap_in, scheduled_spec_decode_tokens=so.scheduled_spec_decode_tokens,
            grammar_bitmask=so.grammar_bitmask, structured_output_request_ids=so.structured_output_request_ids,
            kv_connector_metadata=so.kv_connector_metadata,
            scheduled_spec_decode_parents=so.scheduled_spec_decode_parents)

    def _num_released(self, table: list[int]) -> int:
        """Leading entries of ``table`` that are the null block."""
        if self.null_block is None:
            return 0
        n = 0
        while n < len(table) and table[n] == self.null_block:
            n += 1
        return n

    @property
    def num_tracked(self) -> int:
        """Requests the workers hold state for (as far as the driver knows)."""
        return len(self._sent)
