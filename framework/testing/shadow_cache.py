"""Model-free KV-correctness oracle: a *shadow cache* that records what every slot holds.

The real engine writes the K/V of position ``p`` of a request into slot
``block_table[p // block_size] * block_size + p % block_size`` and later reads every position
``< num_computed_tokens + num_scheduled`` of the request through the same table. The K/V of
position ``p`` is a function of the request's tokens ``0..p`` (causal attention) and of its LoRA adapter, so a
slot is correct for a reader iff it was last written by *some* request with the same token prefix up to ``p``
under the same adapter (or both under the base model). The shadow cache stores, per slot, a fingerprint of that prefix; each simulated step first
applies every write of the step (the backend contract: all of a step's K/V is written before any
read), then asserts that every slot each scheduled request reads holds its own prefix fingerprint.
Prefix-cache hits, chunked prefill, preemption (recompute or swap: the step's swap copies are
mirrored first), eviction and speculative decoding (draft positions are written with the draft's
prefix; rejected ones must never be read before they are overwritten) all reduce to these two
rules, so the simulator catches a stale prefix-cache entry, a block handed to two writers, or a
rejected draft's K/V leaking into a later read or into the prefix cache.

KV cache groups (sliding-window KV memory): each group has its own block table, and a slot holds one
group's K/V (the fingerprint records which). A sliding group (window W) reads only the keys its
queries see (from ``start - W + 1``, ``start`` the first query), so released blocks are never read;
the simulator also asserts that nothing is written into the null block and that a sliding group no
longer holds any block wholly before the window of the step's first query (the saving is real).

Use :func:`simulate` with any scheduler built from registered plugins (it drives the real
``Scheduler`` with a fake runner that samples deterministic tokens). The reads and writes are
checked on what a worker rank sees: each step's ``SchedulerOutput`` goes through the executors'
message path (``StepMessageBuilder`` on the driver, ``InputBatch`` on the worker), and the worker's
mirrored tokens, block tables and computed counts must equal the driver's.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from framework import registry
from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.step_message import StepMessageBuilder
from framework.core.stop import StopChecker
from framework.core.swap import SwapSpace
from framework.interfaces import KVCacheGroup
from framework.interfaces.kv_allocator import FULL_ATTENTION
from framework.worker.input_batch import InputBatch


@dataclass
class Arrival:
    """One request of a simulated workload."""

    step: int  # engine step at which it is added
    request: Request  # a fresh request (status WAITING)


@dataclass
class ShadowCache:
    """Slot -> (KV cache group, fingerprint of the token prefix) whose K/V the slot holds (absent: never written)."""

    block_size: int
    groups: tuple[KVCacheGroup, ...] = (FULL_ATTENTION,)  # the allocator's KV cache groups
    null_block: int = -1  # the allocator's null block id (released entries)
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)
    swap: dict[int, tuple[int, int]] = field(default_factory=dict)  # swap-space slot -> (group, fingerprint)

    def slot(self, table: Sequence[int], pos: int) -> int:
        """Cache slot of token position ``pos`` under block table ``table``."""
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


def _fingerprints(tokens: Sequence[int], end: int, lora_int_id: int = 0) -> list[int]:
    """Fingerprint of each prefix ``tokens[:p + 1]`` for ``p < end`` (a chained hash, O(end)), computed under LoRA
    adapter ``lora_int_id`` (0: the base model): K/V of one prefix under two adapters differs, so a slot written
    under one is foreign to a reader under another."""
    out, h = [], hash(("lora", lora_int_id)) if lora_int_id else 0
    for token in list(tokens)[:end]:
        h = hash((h, token))
        out.append(h)
    return out


def apply_swaps(shadow: ShadowCache, out: SchedulerOutput) -> None:
    """Mirror the step's swap copies (all swap-outs, then all swap-ins) in the shadow cache, as the
    runner performs them before the forward.

    Raises:
        AssertionError: a swap copies the null block (a swapped request swaps only what it still holds).
    """
    bs = shadow.block_size
    for blocks, _ in out.swap_out + [(b, s) for s, b in out.swap_in]:
        assert shadow.null_block not in blocks, f"a swap copies the null block: {blocks}"
    for blocks, swap_slots in out.swap_out:
        for block, slot in zip(blocks, swap_slots, strict=True):
            for off in range(bs):
                if block * bs + off in shadow.slots:
                    shadow.swap[slot * bs + off] = shadow.slots[block * bs + off]
                else:
                    shadow.swap.pop(slot * bs + off, None)
    for swap_slots, blocks in out.swap_in:
        for slot, block in zip(swap_slots, blocks, strict=True):
            for off in range(bs):
                if slot * bs + off in shadow.swap:
                    shadow.slots[block * bs + off] = shadow.swap[slot * bs + off]
                else:
                    shadow.slots.pop(block * bs + off, None)


def check_step(shadow: ShadowCache, out: SchedulerOutput) -> None:
    """Apply the step's writes to ``shadow``, then check every read of every scheduled request.

    Called after ``Scheduler.schedule()`` and before ``update_from_output`` (so
    ``num_computed_tokens`` is still the pre-step value).

    Raises:
        AssertionError: a scheduled request would read a slot that does not hold its prefix (in its
            group), writes into the null block, or a sliding group still holds a block no query reads.
    """
    bs, null = shadow.block_size, shadow.null_block
    reads: list[tuple[Request, tuple[list[int], ...], list[int]]] = []
    for request in out.scheduled_requests:
        rid, start = request.request_id, request.num_computed_tokens
        end = start + out.num_scheduled_tokens[rid]
        tables = out.block_ids[rid]
        assert len(tables) == len(shadow.groups), f"{rid}: {len(tables)} block tables for {len(shadow.groups)} groups"
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        lora_int_id = request.lora_request.lora_int_id if request.lora_request is not None else 0
        fps = _fingerprints([*request.all_token_ids, *drafts], end, lora_int_id)
        for g, (group, table) in enumerate(zip(shadow.groups, tables)):
            assert len(table) * bs >= end, f"{rid}: group {g}'s block table covers {len(table) * bs} tokens, needs {end}"
            kept = [i for i in range(min(group.num_skipped_blocks(start, bs), len(table))) if table[i] != null]
            assert not kept, (f"{rid}: group {g} (window {group.sliding_window}) still holds blocks {kept} that no "
                              f"query from position {start} reads: they should be released")
            for pos in range(start, end):  # the forward writes this step's K/V
                assert table[pos // bs] != null, f"{rid}: group {g} writes position {pos} into the null block"
                shadow.slots[shadow.slot(table, pos)] = (g, fps[pos])
        reads.append((request, tables, fps))
    for request, tables, fps in reads:  # then every layer attends over the keys its window shows
        start = request.num_computed_tokens
        for g, (group, table) in enumerate(zip(shadow.groups, tables)):
            first = 0 if group.sliding_window is None else max(0, start - group.sliding_window + 1)
            for pos in range(first, len(fps)):
                slot = shadow.slot(table, pos)
                held = shadow.slots.get(slot)
                assert held == (g, fps[pos]), (
                    f"request {request.request_id!r} group {g} reads position {pos} from slot {slot} (block "
                    f"{table[pos // bs]}) which holds {'nothing' if held is None else 'another prefix or group'}: "
                    "stale or foreign KV")


def check_worker_view(out: SchedulerOutput, view: SchedulerOutput) -> None:
    """The worker's view of a step (its ``InputBatch`` after the step's message) equals the driver's.

    Raises:
        AssertionError: a scheduled request whose mirrored tokens, block table or computed count
            differs, or a different order or swap list.
    """
    assert [r.request_id for r in view.scheduled_requests] == [r.request_id for r in out.scheduled_requests]
    for mine, theirs in zip(view.scheduled_requests, out.scheduled_requests):
        rid = theirs.request_id
        assert mine.all_token_ids == theirs.all_token_ids, f"{rid}: worker tokens differ from the driver's"
        assert mine.num_computed_tokens == theirs.num_computed_tokens, f"{rid}: worker num_computed_tokens differs"
        assert list(view.block_ids[rid]) == list(out.block_ids[rid]), f"{rid}: worker block table differs"
    assert view.num_scheduled_tokens == out.num_scheduled_tokens and view.swap_out == out.swap_out
    assert view.swap_in == out.swap_in and view.scheduled_spec_decode_tokens == out.scheduled_spec_decode_tokens


def fake_runner(out: SchedulerOutput, token_of: Callable[[Request], int],
                rng: random.Random | None = None) -> ModelRunnerOutput:
    """Sample ``token_of(request)`` for each request whose scheduled real tokens reach its end; a
    request verifying drafts accepts a random number ``a`` of them (``rng``; all when None) and
    outputs ``drafts[:a] + [token_of(request)]``, as the rejection sampler would."""
    sampled, accepted = {}, {}
    for r in out.scheduled_requests:
        drafts = out.scheduled_spec_decode_tokens.get(r.request_id, [])
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] - len(drafts) != r.num_tokens:
            continue
        a = len(drafts) if rng is None else rng.randint(0, len(drafts))
        sampled[r.request_id] = [*drafts[:a], token_of(r)]
        if drafts:
            accepted[r.request_id] = a
    return ModelRunnerOutput(sampled_token_ids=sampled, num_accepted_tokens=accepted)


def propose_drafts(scheduler: Scheduler, k: int, rng: random.Random) -> None:
    """A fake drafter: give each running request in its decode phase up to ``k`` random draft
    tokens, capped like ``DraftProposer.propose`` (framework/engine/draft_proposer.py) (never past ``max_model_len`` or ``max_tokens``)."""
    for r in scheduler.running:
        if r.num_computed_tokens != r.num_tokens - 1:
            continue
        max_tokens = r.sampling_params.max_tokens or scheduler.max_model_len
        room = min(scheduler.max_model_len - r.num_tokens, max_tokens - r.num_output_tokens) - 1
        r.spec_token_ids = [rng.randint(3, 9) for _ in range(max(0, min(k, room)))]


def simulate(scheduler: Scheduler, arrivals: Sequence[Arrival], token_of: Callable[[Request], int] | None = None,
             max_steps: int = 2000, after_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
             num_speculative_tokens: int = 0, seed: int = 0, batches_in_flight: int = 1) -> int:
    """Drive ``scheduler`` through ``arrivals`` with the shadow-cache check on every step.

    Args:
        scheduler: a fresh scheduler (any allocator x policy x preemption mode).
        arrivals: requests with the step at which each is added.
        token_of: token the fake runner samples for a request (default: a function of its length,
            so identical prefixes produce identical continuations and prefix hits recur).
        max_steps: fail when the run has not finished after this many steps.
        after_step: optional extra check after each step's update (e.g. allocator invariants).
        num_speculative_tokens: > 0 turns on speculative steps: before each step decoding requests
            get up to this many random drafts, and the fake runner accepts a random prefix of them.
        seed: seeds the drafts and acceptances.
        batches_in_flight: up to this many scheduled batches wait for their output at once, as
            ``LLMEngine.step`` runs them through its batch queue under pipeline parallelism
            (framework/engine/batch_queue.py): a batch is scheduled while fewer are in flight, and the
            oldest is applied when the queue is full or nothing new could be scheduled. Each batch's
            reads and writes are checked when it is scheduled (the stages run batches in that order).

    Returns:
        The number of steps run (schedules).

    Raises:
        AssertionError: a KV read of stale/foreign content, or no progress within ``max_steps``.
        ValueError: speculative steps with more than one batch in flight (the engine refuses the pair).
    """
    if num_speculative_tokens and batches_in_flight > 1:
        raise ValueError("speculative decoding runs one batch at a time (pipeline parallelism refuses it)")
    token_of = token_of or (lambda r: 3 + (r.num_tokens * 7 + r.all_token_ids[0]) % 11)
    shadow = ShadowCache(scheduler.kv.block_size, scheduler.kv.kv_cache_groups, scheduler.kv.null_block)
    pending = sorted(arrivals, key=lambda a: a.step)
    rng = random.Random(seed) if num_speculative_tokens else None
    messages, worker = StepMessageBuilder(scheduler.kv.null_block), InputBatch(scheduler.kv.null_block)
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    step = 0
    while pending or scheduler.has_unfinished_requests() or queue:
        while pending and pending[0].step <= step:
            scheduler.add_request(pending.pop(0).request)
        if len(queue) < batches_in_flight:
            if rng is not None:
                propose_drafts(scheduler, num_speculative_tokens, rng)
            out = scheduler.schedule()
            step += 1
            assert step < max_steps, f"scheduler made no progress in {max_steps} steps"
            worker_view = worker.apply(messages.build(out))
            check_worker_view(out, worker_view)
            apply_swaps(shadow, worker_view)
            check_step(shadow, worker_view)
            batch = (out, fake_runner(out, token_of, rng))  # the forward runs on what was scheduled
            if out.reaches_workers:  # as LLMEngine.step: submitted
                queue.append(batch)
                if len(queue) < batches_in_flight:
                    continue  # room for another batch: schedule it before waiting for the oldest
            elif not queue:
                queue.append(batch)  # nothing scheduled and nothing in flight: an idle step, applied at once
        out, runner_out = queue.popleft()
        scheduler.update_from_output(out, runner_out)
        if after_step is not None:
            after_step(scheduler, out)
    return step


def kv_cache_group_layouts(windows: Sequence[int]) -> list[tuple[KVCacheGroup, ...]]:
    """Model shapes for the simulation from two windows ``(w1, w2)``: full attention, every layer windowed
    (Mistral), mixed full and sliding (Gemma 2, gpt-oss), one full and two sliding groups (Gemma 3's
    grouping), two windows."""
    w1, w2 = windows
    full, slide, slide2 = KVCacheGroup((0,)), KVCacheGroup((1,), w1), KVCacheGroup((2,), w1)
    return [(FULL_ATTENTION,), (slide,), (full, slide), (full, slide, slide2), (slide, KVCacheGroup((2,), w2))]


def check_against_shadow_cache(allocator_cls: type, policies: Sequence[str] = ("fcfs", "priority"),
                               num_workloads: int = 30, seed: int = 0, **allocator_params: object) -> None:
    """Conformance check for a KV allocator plugin: seeded random workloads (shared prefixes, chunked
    prefill, KV pressure, priorities, speculative steps) through the real scheduler with each policy and
    both preemption modes, every step checked against the shadow cache and the allocator returning every block.

    Args:
        allocator_cls: a ``KVAllocator`` subclass, constructed with ``num_blocks``, ``block_size``,
            ``enable_prefix_caching``, ``max_model_len`` and ``allocator_params``.
        policies: registered scheduler policy names to drive it with.
        num_workloads: random workloads per (policy, preemption mode); with ``supports_kv_cache_groups``
            each draws a model shape of :func:`kv_cache_group_layouts` (windows of 1 .. 3 blocks + 2).

    Raises:
        AssertionError: a stale/foreign KV read, a leaked block, or no progress.
    """

    rng = random.Random(seed)
    for policy in policies:
        for swap in (False, True):
            for _ in range(num_workloads):
                bs, num_blocks = rng.choice([1, 2, 4]), rng.randint(6, 16)
                max_len = num_blocks * bs
                if getattr(allocator_cls, "supports_kv_cache_groups", False):
                    windows = [rng.randint(1, 3 * bs + 2) for _ in range(2)]
                    allocator_params["kv_cache_groups"] = rng.choice(kv_cache_group_layouts(windows))
                    num_blocks *= len(allocator_params["kv_cache_groups"])
                kv = allocator_cls(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=rng.random() < 0.8,
                                   max_model_len=max_len, **allocator_params)
                sched = Scheduler(registry.create("scheduler", policy), kv, StopChecker(tokenizer=None),
                                  max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(max(4, bs), 32),
                                  max_model_len=max_len, long_prefill_token_threshold=rng.choice([0, 2, 4, 8]),
                                  swap_space=SwapSpace(num_blocks // 2) if swap else None)
                base = [rng.randint(3, 6) for _ in range(max_len)]
                arrivals = []
                for i in range(rng.randint(1, 6)):
                    tokens = (base[:rng.randint(0, max_len // 2)] + [rng.randint(3, 9) for _ in range(
                        rng.randint(1, max(1, max_len // 2)))])[:max_len - 1]
                    params = SamplingParams(max_tokens=rng.randint(1, max(1, min(6, max_len - len(tokens)))))
                    step = rng.randint(0, 4)
                    arrivals.append(Arrival(step, Request(f"r{i}", tokens, params, priority=rng.randint(0, 3),
                                                          arrival_time=float(step), eos_token_ids=frozenset())))
                simulate(sched, arrivals, num_speculative_tokens=rng.choice([0, 0, 3]), seed=rng.randrange(1 << 30))
                assert kv.num_free_blocks == kv.num_blocks, f"{allocator_cls.__name__} leaked KV blocks"
