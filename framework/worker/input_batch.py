"""A worker's mirror of the requests it computes (vLLM V1's ``CachedRequestState`` / ``InputBatch``).

Every rank applies each step's :class:`framework.core.step_message.StepMessage` to its
:class:`InputBatch` and gets back a ``SchedulerOutput`` over its own request states, which the
model runner flattens exactly as it would the driver's (same fields, same order). The driver rank
also samples from these states: per-request generators, penalties over its mirrored output tokens
and ``min_tokens`` live here, not on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from framework.core.outputs import SchedulerOutput
from framework.core.sampling_params import SamplingParams
from framework.core.step_message import StepMessage


@dataclass(eq=False)
class CachedRequestState:
    """One request as a worker knows it. Field names match ``framework.core.request.Request``, so the
    model runner, the sampler and the rejection sampler read either."""

    request_id: str
    prompt_token_ids: list[int]  # (num_prompt_tokens,) token ids
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # model EOS ids (min_tokens)
    block_ids: tuple[list[int], ...]  # block table per KV cache group, in token order
    num_computed_tokens: int  # tokens whose K/V are cached (the driver's value at schedule time)
    output_token_ids: list[int] = field(default_factory=list)  # generated tokens, as appended by the driver
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output
    generator: torch.Generator | None = None  # per-request RNG (seeded requests), advanced on the driver rank

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_tokens(self) -> int:
        """Prompt + output length in tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output length in tokens."""
        return len(self.output_token_ids)

    def append_tokens(self, token_ids: list[int]) -> None:
        """Append tokens the driver appended to the request's output."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)


class InputBatch:
    """The worker's request states, updated from each step's message.

    Args:
        null_block: the null block's id (released entries of sliding-window groups).
    """

    def __init__(self, null_block: int = -1) -> None:
        self.null_block = null_block
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, step: StepMessage) -> SchedulerOutput:
        """Apply ``step`` (finished, then new, then cached requests) and return the step as a
        ``SchedulerOutput`` over this worker's states, in the scheduler's order.

        Raises:
            KeyError: the message names a cached request this worker never received (a protocol bug).
        """
        for rid in step.finished_req_ids:
            self.requests.pop(rid, None)
        for new in step.new_reqs:
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id, prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params, eos_token_ids=new.eos_token_ids,
                block_ids=tuple(list(t) for t in new.block_ids),
                num_computed_tokens=new.num_computed_tokens, output_token_ids=list(new.output_token_ids))
        cached = step.cached_reqs
        for i, rid in enumerate(cached.request_ids):
            state = self.requests[rid]
            if cached.new_token_ids[i]:
                state.append_tokens(cached.new_token_ids[i])
            if cached.resumed_from_preemption[i]:
                state.block_ids = tuple(list(t) for t in cached.new_block_ids[i])
            else:
                for table, appended, released in zip(state.block_ids, cached.new_block_ids[i],
                                                     cached.num_released_blocks[i]):
                    table.extend(appended)
                    table[:released] = [self.null_block] * released
            state.num_computed_tokens = cached.num_computed_tokens[i]
        scheduled = [self.requests[rid] for rid in step.num_scheduled_tokens]
        return SchedulerOutput(
            scheduled_requests=scheduled,  # type: ignore[arg-type] - CachedRequestState reads like Request
            num_scheduled_tokens=step.num_scheduled_tokens,
            total_num_scheduled_tokens=step.total_num_scheduled_tokens,
            block_ids={r.request_id: r.block_ids for r in scheduled},
            finished_req_ids=step.finished_req_ids, swap_out=step.swap_out, swap_in=step.swap_in,
            scheduled_spec_decode_tokens=step.scheduled_spec_decode_tokens,
            grammar_bitmask=step.grammar_bitmask, structured_output_request_ids=step.structured_output_request_ids)
