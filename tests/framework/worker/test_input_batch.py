"""The workers' request mirror (``InputBatch``) fed by the driver's ``StepMessage`` deltas reproduces
the driver's batch exactly: the runner's prepared inputs are equal to those built from the driver's
own requests (the pre-executor path) on mixed steps, and a decode step's message stays small."""

from __future__ import annotations

import pickle
import random

import numpy as np
import torch

from framework import registry
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.step_message import StepMessageBuilder
from framework.core.stop import StopChecker
from framework.core.swap import SwapSpace
from framework.testing.shadow_cache import fake_runner, propose_drafts
from framework.worker.input_batch import InputBatch, prepare_inputs

BLOCK = 4


def _prepare(so):
    """``prepare_inputs`` needs only the block size and the device."""
    return prepare_inputs(so, BLOCK, torch.device("cpu"))


def _assert_same_inputs(a, b) -> None:
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    assert [r.request_id for r in a.sample_requests] == [r.request_id for r in b.sample_requests]
    for name in ("input_ids", "positions", "logits_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("query_start_loc", "seq_lens", "context_lens", "block_table", "slot_mapping"):
        assert torch.equal(getattr(a.common, name), getattr(b.common, name)), name
    assert a.num_spec == b.num_spec and a.common.num_decodes == b.common.num_decodes
    np.testing.assert_array_equal(a.query_start_loc_cpu, b.query_start_loc_cpu)


def _scheduler(num_blocks: int = 14) -> Scheduler:
    kv = registry.create("kv_allocator", "paged", num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=True,
                         max_model_len=num_blocks * BLOCK)
    return Scheduler(registry.create("scheduler", "fcfs"), kv, StopChecker(tokenizer=None), max_num_seqs=6,
                     max_num_batched_tokens=20, max_model_len=num_blocks * BLOCK, long_prefill_token_threshold=8,
                     swap_space=SwapSpace(8))


def test_prepared_inputs_equal_the_drivers_on_mixed_steps():
    """Chunked prefill, decodes, spec-verify rows, prefix hits and swap preemption in the same run."""
    rng = random.Random(0)
    sched, builder, worker = _scheduler(), StepMessageBuilder(), InputBatch()
    base = [rng.randint(3, 30) for _ in range(24)]
    for i in range(7):
        prompt = base[:rng.randint(0, 12)] + [rng.randint(3, 30) for _ in range(rng.randint(2, 14))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(4, 12), seed=i)))
    seen = {"decode": 0, "chunk": 0, "verify": 0, "swap_in": 0, "mixed": 0}
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        propose_drafts(sched, 3, rng)
        out = sched.schedule()
        if out.is_empty:
            continue
        view = worker.apply(builder.build(out))
        _assert_same_inputs(_prepare(view), _prepare(out))
        n = out.num_scheduled_tokens
        kinds = {"decode": any(v == 1 for v in n.values()), "verify": bool(out.scheduled_spec_decode_tokens),
                 "chunk": any(r.num_computed_tokens + n[r.request_id] < r.num_tokens for r in out.scheduled_requests),
                 "swap_in": bool(out.swap_in)}
        seen.update({k: seen[k] + v for k, v in kinds.items()})
        seen["mixed"] += sum(kinds.values()) >= 3
        sched.update_from_output(out, fake_runner(out, lambda r: 3 + r.num_tokens % 7, rng))
    assert not sched.has_unfinished_requests()
    assert all(seen.values()), seen
    worker.apply(builder.build(sched.schedule()))  # the next message drops the last finished requests
    assert not worker.requests and builder.num_tracked == 0


def _decode_message_sizes(prompt_len: int) -> list[int]:
    """Pickled bytes of the step messages of 4 requests' decode steps (prefill steps skipped)."""
    kv = registry.create("kv_allocator", "paged", num_blocks=2048, block_size=BLOCK, enable_prefix_caching=False,
                         max_model_len=2048)
    sched = Scheduler(registry.create("scheduler", "fcfs"), kv, StopChecker(tokenizer=None), max_num_seqs=8,
                      max_num_batched_tokens=4096, max_model_len=2048)
    builder, worker = StepMessageBuilder(), InputBatch()
    for i in range(4):
        sched.add_request(Request(f"r{i}", [3 + (i + j) % 50 for j in range(prompt_len)], SamplingParams(max_tokens=8)))
    sizes = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        message = builder.build(out)
        worker.apply(message)
        if not message.new_reqs:
            assert [len(t) for t in message.cached_reqs.new_token_ids] == [1] * 4  # the last sampled token
            sizes.append(len(pickle.dumps(message)))
        sched.update_from_output(out, fake_runner(out, lambda r: 5))
    return sizes


def test_decode_message_size_does_not_grow_with_the_prompt():
    """Once admitted, a request costs the step message its new token and blocks, never its prompt."""
    short, long = _decode_message_sizes(40), _decode_message_sizes(1000)
    assert len(short) == len(long) == 7
    assert max(long) <= max(short) + 16  # same deltas; a new block id or a larger int at most
    assert max(long) < 1000  # bytes, for 4 requests
