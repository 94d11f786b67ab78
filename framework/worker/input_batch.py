"""A worker's mirror of the requests it computes (vLLM V1's ``CachedRequestState`` / ``InputBatch``), and the
flattening of a step into the model's inputs and attention metadata (:func:`prepare_inputs`, over the block tables
of every KV cache group: :func:`block_table`).

Every rank applies each step's :class:`framework.core.step_message.StepMessage` to its
:class:`InputBatch` and gets back a ``SchedulerOutput`` over its own request states, which the
model runner flattens exactly as it would the driver's (same fields, same order). The driver rank
also samples from these states: per-request generators, penalties over its mirrored output tokens
and ``min_tokens`` live here, not on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from framework.core.lora_request import LoRARequest
from framework.core.outputs import SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.spec_tree import ancestor_mask, tree_depths
from framework.core.step_message import StepMessage
from framework.interfaces import CommonAttentionMetadata, SpecTreeMask
from framework.sample.prompt_logprobs import PromptLogprobRows, prompt_logprob_rows


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
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)

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
                num_computed_tokens=new.num_computed_tokens, output_token_ids=list(new.output_token_ids),
                lora_request=new.lora_request)
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
            grammar_bitmask=step.grammar_bitmask, structured_output_request_ids=step.structured_output_request_ids,
            kv_connector_metadata=step.kv_connector_metadata,
            scheduled_spec_decode_parents=step.scheduled_spec_decode_parents)


@dataclass
class BatchInputs:
    """Inputs of one step, requests reordered decodes first (built by ``ModelRunner.prepare_inputs``)."""

    requests: list[Request]  # batch order
    input_ids: torch.Tensor  # (1, num_tokens) int64
    positions: torch.Tensor  # (1, num_tokens) int64
    common: CommonAttentionMetadata  # the first KV cache group's (the only one without sliding-window groups)
    group_commons: list[CommonAttentionMetadata]  # per KV cache group: the same batch with its block table and slots
    sample_requests: list[Request]  # requests whose last scheduled token reaches num_tokens (+ drafts)
    # (num_sample_rows + num_prompt_rows,) int64 flattened token index of each row whose logits the step
    # needs: the sampled rows, then the prompt-logprob rows (prompt_rows)
    logits_index: torch.Tensor
    num_sample_rows: int  # leading rows of logits_index that sample
    prompt_rows: PromptLogprobRows | None  # trailing rows: prompt logprobs (None when no request asked)
    num_spec: list[int]  # per sample request: drafts verified this step (rows = num_spec + 1)
    query_start_loc_cpu: np.ndarray  # (num_reqs + 1,) int64, host copy of common.query_start_loc
    context_lens_cpu: np.ndarray  # (num_reqs,) int64, host copy of common.context_lens


def block_table(so: SchedulerOutput, requests: list[Request], group: int) -> np.ndarray:
    """``(num_reqs, max_blocks)`` int64 block ids of one KV cache group, batch order, padded with 0."""
    tables = [so.block_ids[r.request_id][group] for r in requests]
    padded = np.zeros((len(requests), max(len(t) for t in tables)), dtype=np.int64)
    for i, table in enumerate(tables):
        padded[i, :len(table)] = table
    return padded


def tree_positions(so: SchedulerOutput, requests: list[Request], query_start_loc: np.ndarray, query_lens: np.ndarray,
                   positions: np.ndarray) -> tuple[np.ndarray, SpecTreeMask | None]:
    """RoPE positions and tree attention of the requests verifying a draft tree (``so.scheduled_spec_decode_parents``).

    A tree's nodes sit at consecutive KV positions after their root (``positions``, which the slot mapping and the
    masks keep), but each node's RoPE position is its root's plus its depth (Medusa, Cai et al. 2024, Sec. 2.3.1).

    Args:
        so: the step; requests: batch order; query_start_loc: ``(num_reqs + 1,)`` int64; query_lens: ``(num_reqs,)``
            int64; positions: ``(num_tokens,)`` int64 consecutive KV positions of the step's tokens.

    Returns:
        ``(rope_positions (num_tokens,) int64, SpecTreeMask or None)``; ``positions`` itself when no request
        verifies a tree.
    """
    trees = so.scheduled_spec_decode_parents
    if not trees:
        return positions, None
    rope = positions.copy()
    reqs, visible = [], []
    for i, request in enumerate(requests):
        parents = trees.get(request.request_id)
        if not parents:
            continue
        end, k = int(query_start_loc[i + 1]), len(parents)
        rope[end - k:end] = positions[end - k - 1] + tree_depths(parents)
        reqs.append(i)
        visible.append(torch.from_numpy(ancestor_mask(parents, int(query_lens[i]) - k)))
    return rope, (SpecTreeMask(reqs, visible) if reqs else None)


def prepare_inputs(so: SchedulerOutput, block_size: int, device: torch.device) -> BatchInputs:
    """Flatten the scheduled tokens of one step (decodes first) into one "super sequence" and its attention
    metadata, per KV cache group; one Python pass over requests, vectorized over tokens.

    Args:
        so: the step (the driver's ``SchedulerOutput`` or a worker's, from its :class:`InputBatch`).
        block_size: tokens per KV block; device: where the tensors go.
    """
    n_sched = so.num_scheduled_tokens
    requests = ([r for r in so.scheduled_requests if n_sched[r.request_id] == 1]
                + [r for r in so.scheduled_requests if n_sched[r.request_id] > 1])
    num_decodes = sum(1 for r in requests if n_sched[r.request_id] == 1)
    query_lens = np.array([n_sched[r.request_id] for r in requests], dtype=np.int64)
    context_lens = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
    seq_lens = context_lens + query_lens
    spec = so.scheduled_spec_decode_tokens
    num_spec = np.array([len(spec.get(r.request_id, ())) for r in requests], dtype=np.int64)
    token_ids: list[int] = []
    for request, start, n, k in zip(requests, context_lens.tolist(), query_lens.tolist(), num_spec.tolist()):
        if k:  # verify: the real tokens, then the drafts
            token_ids.extend(request.all_token_ids[start:start + n - k])
            token_ids.extend(spec[request.request_id])
        else:
            token_ids.extend(request.all_token_ids[start:start + n])
    query_start_loc = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    req_of_token = np.repeat(np.arange(len(requests)), query_lens)
    positions = context_lens[req_of_token] + np.arange(num_tokens) - query_start_loc[req_of_token]

    rope_positions, spec_tree = tree_positions(so, requests, query_start_loc, query_lens, positions)

    num_groups = len(so.block_ids[requests[0].request_id])  # KV cache groups (one table each)
    group_tables = [block_table(so, requests, g) for g in range(num_groups)]
    first_table = group_tables[0]
    token_block, token_offset = positions // block_size, positions % block_size
    slot_mapping = first_table[req_of_token, token_block] * block_size + token_offset

    is_last = seq_lens == np.array([r.num_tokens for r in requests], dtype=np.int64) + num_spec
    sample_idx = np.nonzero(is_last)[0]
    # k+1 rows per speculating request: the positions of its last real token and its drafts
    sample_k = num_spec[sample_idx]
    row_req = np.repeat(sample_idx, sample_k + 1)
    row_off = np.arange(int((sample_k + 1).sum())) - np.repeat(np.cumsum(sample_k + 1) - (sample_k + 1),
                                                               sample_k + 1)
    logits_index = query_start_loc[row_req + 1] - np.repeat(sample_k + 1, sample_k + 1) + row_off
    num_sample_rows = len(logits_index)
    prompt_rows = prompt_logprob_rows(requests, query_start_loc, context_lens, query_lens)
    if prompt_rows is not None:
        logits_index = np.concatenate([logits_index, prompt_rows.token_index])
    dev = device
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(query_start_loc).to(dev, torch.int32),
        seq_lens=torch.from_numpy(seq_lens).to(dev, torch.int32),
        context_lens=torch.from_numpy(context_lens).to(dev, torch.int32),
        block_table=torch.from_numpy(first_table).to(dev, torch.int32),
        slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        query_lens_cpu=query_lens.tolist(), seq_lens_cpu=seq_lens.tolist(),
        num_reqs=len(requests), num_tokens=num_tokens, num_decodes=num_decodes,
        num_decode_tokens=num_decodes, max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()), block_size=block_size, spec_tree=spec_tree,
    )
    group_commons = [common] + [  # the other groups: same batch, their own tables and slots
        replace(common, block_table=torch.from_numpy(table).to(dev, torch.int32),
                slot_mapping=torch.from_numpy(table[req_of_token, token_block] * block_size
                                              + token_offset).to(dev))
        for table in group_tables[1:]]
    return BatchInputs(
        requests=requests,
        input_ids=torch.tensor(token_ids, dtype=torch.long, device=dev)[None],
        positions=torch.from_numpy(rope_positions).to(dev)[None],
        common=common,
        group_commons=group_commons,
        sample_requests=[requests[i] for i in sample_idx.tolist()],
        logits_index=torch.from_numpy(logits_index).to(dev),
        num_sample_rows=num_sample_rows,
        prompt_rows=prompt_rows,
        num_spec=sample_k.tolist(),
        query_start_loc_cpu=query_start_loc,
        context_lens_cpu=context_lens,
    )


def dummy_batch(num_tokens: int, num_reqs: int, block_size: int, num_blocks_total: int,
                device: torch.device) -> tuple[torch.Tensor, CommonAttentionMetadata]:
    """A dummy step's positions ``(num_tokens,)`` int64 and attention metadata, for warm-up and timing forwards
    (``ModelRunner._dummy_forward``) over a cache of ``num_blocks_total`` blocks of ``block_size`` tokens.

    ``num_reqs == 1``: a prefill of ``num_tokens`` tokens (at most the cache's slots) at positions ``0..``, its
    K/V in blocks ``0, 1, ...``. ``num_reqs == num_tokens``: that many decodes, each at position
    ``2 * block_size`` of a 3-block table of its own (blocks ``3i..3i+2``; all share blocks 0-2 in a cache too
    small). ``common.num_tokens`` is the token count actually used.
    """
    i32 = {"dtype": torch.int32, "device": device}
    if num_reqs == 1:
        num_tokens = min(num_tokens, num_blocks_total * block_size)
        num_blocks, ctx, q_lens = -(-num_tokens // block_size), [0], [num_tokens]
        positions = torch.arange(num_tokens, device=device)
        slots = positions
        table = torch.arange(num_blocks, **i32)[None]
    else:
        num_blocks = min(3, num_blocks_total)
        ctx, q_lens = [(num_blocks - 1) * block_size] * num_reqs, [1] * num_reqs
        positions = torch.tensor(ctx, device=device)
        # each request its own blocks where the cache has them (as in a real step, attention reads distinct
        # K/V), else all share blocks 0..num_blocks-1; the new token at the start of the table's last block
        rows = num_reqs if num_blocks * num_reqs <= num_blocks_total else 1
        table = torch.arange(rows * num_blocks, **i32).view(rows, num_blocks).repeat(num_reqs // rows, 1)
        slots = table[:, -1].long() * block_size
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    num_decodes = sum(q == 1 for q in q_lens)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *np.cumsum(q_lens).tolist()], **i32),
        seq_lens=torch.tensor(seq_lens, **i32), context_lens=torch.tensor(ctx, **i32),
        block_table=table, slot_mapping=slots,
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, num_reqs=num_reqs, num_tokens=num_tokens,
        num_decodes=num_decodes, num_decode_tokens=num_decodes, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), block_size=block_size)
    return positions, common
