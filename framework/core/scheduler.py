"""Scheduler core: one rule for prefill, decode, chunked prefill, prefix hits and preemption.

Follows vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``): there are no phases; each
request's ``num_computed_tokens`` catches up with ``num_tokens`` within a per-step token budget.
Running requests are served first (decodes and unfinished chunks), then waiting requests are
admitted in policy order. When the KV allocator says no, the policy's victim is preempted by
recompute (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP'23, Sec. 4.5).

Batches in flight (pipeline parallelism) follow :mod:`framework.core.in_flight`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from framework.core.clock import WALL_CLOCK, Clock
from framework.core.faults import RequestFailure, RequestFaults
from framework.core.in_flight import InFlight
from framework.core.kv_transfer import KVTransfer, LoadFailure
from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.core.stop import StopChecker
from framework.core.swap import SwapSpace
from framework.interfaces import KVAllocator, SchedulerPolicy


class Scheduler:
    """Chooses which tokens each step computes and applies the step's results.

    Args:
        policy: waiting-queue order, preemption victim and may-preempt rule.
        kv_allocator: block ownership; the scheduler is its only caller.
        stop_checker: decides when a request is finished after a new token.
        max_num_seqs: max requests in one step.
        max_num_batched_tokens: token budget of one step.
        max_model_len: prompt + output cap, tokens.
        long_prefill_token_threshold: cap on one request's prefill chunk per step (0: none).
        swap_space: CPU swap slots for ``preemption_mode=swap`` (vLLM's swapping preemption); ``None``
            preempts by recompute. A victim is swapped when its written blocks fit, else recomputed.
        clock: the run's time source (``Executor.clock``) for request timestamps; also handed to the
            policy (``SchedulerPolicy.use_clock``). ``None``: wall time, and the policy keeps its own.
        kv_transfer: the scheduler side of a KV connector (``framework/core/kv_transfer.py``): external prompt
            tokens at admission, the step's connector metadata, load failures; ``None``: no connector.

    Attributes:
        faults: failures of single requests (``framework.core.faults``); the stop checker runs under it
            here, and the engine shares it with its other per-request call sites and aborts what it holds.
    """

    def __init__(self, policy: SchedulerPolicy, kv_allocator: KVAllocator, stop_checker: StopChecker,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 long_prefill_token_threshold: int = 0, swap_space: SwapSpace | None = None,
                 clock: Clock | None = None, max_loras: int = 0, kv_transfer: KVTransfer | None = None) -> None:
        self.policy = policy
        self.kv_transfer = kv_transfer
        if kv_transfer is not None:
            kv_transfer.attach(kv_allocator)
        self.clock = clock or WALL_CLOCK
        self.kv = kv_allocator
        self.stop_checker = stop_checker
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_loras = max_loras  # distinct LoRA adapters in the running set (one step); 0: no LoRA, no limit
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.waiting: list[Request] = []  # re-ranked by the policy at the start of every schedule()
        self.running: list[Request] = []  # admission order
        self._finished_ids: set[str] = set()  # finished since the last schedule()
        self.in_flight = InFlight()  # ids of batches whose output update_from_output has not applied yet
        self.num_preemptions_last_step = 0
        self.swap_space = swap_space
        self._swap_out: list[tuple[list[int], list[int]]] = []  # this step's (device blocks, swap slots)
        self._swap_in: list[tuple[list[int], list[int]]] = []  # this step's (swap slots, device blocks)
        self.faults = RequestFaults()
        self._swapped: dict[str, list[tuple[int, int]]] = {}  # swapped-out request -> (group, table index) per slot
        policy.attach(self._num_cached_prefix_tokens)
        if clock is not None:
            policy.use_clock(clock.now)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request (status WAITING)."""
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _num_cached_prefix_tokens(self, request: Request) -> int:
        """Read-only prefix-cache lookup handed to the policy (``lpm``): tokens a hit would serve."""
        return 0 if request.sampling_params.prompt_logprobs is not None else self.kv.get_computed_blocks(request)[1]

    def abort_requests(self, request_ids: Iterable[str],
                       failures: Mapping[str, RequestFailure] | None = None) -> list[Request]:
        """Finish the given requests as aborted, freeing their blocks; unknown ids are ignored.

        ``failures``: why requests failed (``RequestFaults``): those get ``error`` and ``internal_error`` set.
        """
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if failures and rid in failures:
                request.error, request.internal_error = failures[rid].error, failures[rid].internal
            if request in self.running:
                self.running.remove(request)
            elif request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:  # parked requests are in no queue
                self.waiting.remove(request)
                if self.swap_space is not None:
                    self.swap_space.drop(rid)
                    self._swapped.pop(rid, None)
            request.status = RequestStatus.FINISHED_ABORTED
            self._finish(request)
            aborted.append(request)
        return aborted

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting, parked or running, or a KV connector still reads a finished one's
        blocks (a delayed free: the engine steps on until the connector reports it)."""
        return bool(self.requests) or (self.kv_transfer is not None and bool(self.kv_transfer.held))

    @property
    def kv_transfers_in_flight(self) -> bool:
        """True while a KV connector's asynchronous load or delayed free waits for its worker side's report: the
        engine runs the workers even on a step with nothing scheduled."""
        return self.kv_transfer is not None and self.kv_transfer.in_flight

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (vLLM's ``reset_prefix_cache``): afterwards no block holds K/V that a
        later request would read without writing it first.

        Returns:
            False (nothing changed) while a request holds KV blocks, or when the allocator cannot reset.
        """
        return not self.running and self.kv.reset_prefix_cache()

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue, and parked ones (``WAITING_FOR_REMOTE_KVS``)."""
        return len(self.waiting) + (len(self.kv_transfer.parked) if self.kv_transfer is not None else 0)

    # ---- scheduling -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens: running requests first, then admissions from waiting.

        Mutates: ``running``/``waiting``, request status, KV ownership (through the allocator). ``num_computed_tokens``
        is advanced in :meth:`update_from_output`, except for prefix-cache hits, which count as computed at admission.
        """
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        # keys may change over time (aging, prefix hits, the running set's adapters): rank afresh every step
        self.policy.observe_running(self.running)
        self.waiting = self.policy.sort_waiting(self.waiting)
        self._preempt_for_waiting(preempted)

        scheduled_running: list[Request] = []
        kv_ran_out = False  # a running request found no free block (it preempted, or waits for an in-flight victim)
        idx = 0
        while idx < len(self.running) and budget > 0:
            request = self.running[idx]
            num_new = 0 if request.request_id in self.in_flight else self._num_new_tokens(request, budget)
            if num_new == 0:
                idx += 1
                continue
            stalled = False
            while self.kv.allocate_slots(request, num_new) is None:
                kv_ran_out = True
                victim = self.policy.select_victim(self.running)
                if victim.request_id in self.in_flight:  # never evict past it: wait until its batch is back
                    stalled = True
                    break
                self._preempt(victim, preempted)
                if victim in scheduled_running:  # give back its tokens
                    scheduled_running.remove(victim)
                    budget += num_scheduled.pop(victim.request_id)
                if victim is request:
                    break
                idx = self.running.index(request)
            else:
                self._track_kv(request)
                scheduled_running.append(request)
                num_scheduled[request.request_id] = num_new
                budget -= num_new
                idx += 1
                continue
            if stalled:  # skipped this step; it keeps its blocks
                idx = self.running.index(request) + 1
            # else it preempted itself; the list shifted, idx points at the next one

        if not kv_ran_out:  # as vLLM: no admissions when KV ran out
            budget = self._admit_waiting(budget, num_scheduled)

        scheduled = [r for r in self.running if r.request_id in num_scheduled]
        spec_tokens = self._scheduled_spec_tokens(scheduled, num_scheduled)
        out = SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            block_ids={r.request_id: self.kv.get_block_tables(r.request_id) for r in scheduled},
            preempted_req_ids=preempted,
            finished_req_ids=self._finished_ids,
            swap_out=self._swap_out, swap_in=self._swap_in, scheduled_spec_decode_tokens=spec_tokens,
            scheduled_spec_decode_parents={r.request_id: r.spec_parents[:len(spec_tokens[r.request_id])]
                                           for r in scheduled if r.spec_parents and r.request_id in spec_tokens},
        )
        if self.kv_transfer is not None:
            out.kv_connector_metadata = self.kv_transfer.build_meta(out)
        self.in_flight.update(num_scheduled)
        self._swap_out, self._swap_in, self._finished_ids = [], [], set()
        self.num_preemptions_last_step = len(preempted)
        now = self.clock.now()
        for request in scheduled:
            if request.times.first_scheduled_s is None:
                request.times.first_scheduled_s = now
        return out

    def _num_new_tokens(self, request: Request, budget: int, num_hit_tokens: int = 0) -> int:
        """Tokens to compute this step: the remainder after ``num_computed_tokens`` plus prefix
        hits, capped by ``long_prefill_token_threshold`` and the budget."""
        num_new = request.num_tokens_with_spec - request.num_computed_tokens - num_hit_tokens
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, budget)

    @staticmethod
    def _scheduled_spec_tokens(scheduled: list[Request], num_scheduled: dict[str, int]) -> dict[str, list[int]]:
        """request_id -> the drafts among its scheduled tokens (drafts trimmed by the budget drop off
        the end; a request whose real tokens did not all fit verifies none)."""
        out: dict[str, list[int]] = {}
        for request in scheduled:
            if not request.spec_token_ids:
                continue
            n_spec = num_scheduled[request.request_id] - (request.num_tokens - request.num_computed_tokens)
            if n_spec > 0:
                out[request.request_id] = request.spec_token_ids[:n_spec]
        return out

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int]) -> int:
        admitted: set[str] = set()
        skipped = False  # a request was passed over (its adapter would exceed max_loras): admitted ones are not a prefix
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        for request in self.waiting:
            if budget <= 0 or self.in_flight.num_schedulable(self.running) >= self.max_num_seqs:
                break
            if request.request_id in self.in_flight:  # an aborted request's id, reused while its batch runs
                skipped = True
                continue
            if not self._lora_fits(request, loras):
                if self.policy.wait_for_lora_slot(request):
                    break  # the policy holds the queue until running adapters drain (its starvation bound)
                skipped = True
                continue  # vLLM's rule: its adapter would exceed max_loras; skipped this step, later ones may go
            computed_blocks, num_hit_tokens, num_external, load_async = self._lookup(request)
            num_new = 0 if load_async else self._num_new_tokens(request, budget, num_hit_tokens + num_external)
            if self.kv.allocate_slots(request, num_external + num_new, computed_blocks) is None:
                break  # head-of-line: no skipping ahead of the policy's order (as vLLM)
            if self.swap_space is not None and request.request_id in self.swap_space:
                self._swap_in.append(self._swap_in_copies(request))
            self._track_kv(request)
            admitted.add(request.request_id)
            if request.num_preemptions == 0 and request.num_computed_tokens == 0:  # not a re-admission after a load
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens += num_hit_tokens
            if self.kv_transfer is not None:
                self.kv_transfer.on_admitted(request, self.kv.get_block_ids(request.request_id), num_external,
                                             load_async)
                if load_async:
                    continue  # parked (WAITING_FOR_REMOTE_KVS) until the connector reports its load done
                request.num_computed_tokens += num_external  # loaded before this step's forward
            if request.lora_request is not None:
                loras.add(request.lora_request.lora_int_id)
            self.policy.on_admitted(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        if skipped:
            self.waiting = [r for r in self.waiting if r.request_id not in admitted]
        else:  # the common case: the admitted requests are the queue's head
            del self.waiting[:len(admitted)]
        return budget

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Whether admitting ``request`` keeps the running set within ``max_loras`` distinct adapters (``loras``:
        the running set's adapter ids); always true for the base model or without LoRA."""
        lora = request.lora_request
        return lora is None or not self.max_loras or lora.lora_int_id in loras or len(loras) < self.max_loras

    def _preempt_for_waiting(self, preempted: set[str]) -> None:
        """Let the head of the waiting queue evict outranked running requests (priority policies)."""
        while self.waiting and self.running:
            candidate = self.waiting[0]
            victim = self.policy.select_victim(self.running)
            if (victim.request_id in self.in_flight or not self.policy.may_preempt(candidate, victim)
                    or self._can_admit(candidate)):
                return  # (an in-flight victim: the candidate waits until its batch is back)
            self._preempt(victim, preempted)

    def _can_admit(self, request: Request) -> bool:
        if self.in_flight.num_schedulable(self.running) >= self.max_num_seqs:
            return False
        hit_blocks, num_hit, num_external, load_async = self._lookup(request)
        first_chunk = 0 if load_async else self._num_new_tokens(request, self.max_num_batched_tokens,
                                                               num_hit + num_external)
        return self.kv.can_allocate(request, num_external + first_chunk, hit_blocks)

    def _lookup(self, request: Request) -> tuple[list[int], int, int, bool]:
        """Prefix-cache lookup for admission: ``(hit blocks, their tokens, tokens the KV connector loads after
        them, whether it loads them asynchronously)``; a swapped-out request brings its own K/V back instead, one
        whose asynchronous load completed holds its blocks already, and a request that asks for prompt logprobs
        reads no cache: its cached tokens' logits would be lost (it still publishes its blocks;
        ``framework/sample/prompt_logprobs.py``)."""
        if self.swap_space is not None and request.request_id in self.swap_space:
            return [], 0, 0, False
        if request.sampling_params.prompt_logprobs is not None or (
                self.kv_transfer is not None and request.request_id in self.kv_transfer.loaded):
            return [], 0, 0, False
        blocks, num_hit = self.kv.get_computed_blocks(request)
        if self.kv_transfer is None:
            return blocks, num_hit, 0, False
        return blocks, num_hit, *self.kv_transfer.num_external_tokens(request, num_hit)

    def _track_kv(self, request: Request) -> None:
        """Record the KV blocks the request holds after an allocation (and its peak so far)."""
        request.kv_blocks = held = self.kv.num_held_blocks(request.request_id)
        if sum(held) > sum(request.peak_kv_blocks):
            request.peak_kv_blocks = held

    def _swap_in_copies(self, request: Request) -> tuple[list[int], list[int]]:
        """``(swap slots, device blocks)`` to copy back for a swapped-out request just re-admitted: each slot
        goes to the block now at its (group, table index), unless that entry is released (its K/V fell out
        of the window while the request waited with the same ``num_computed_tokens``: nothing reads it)."""
        slots = self.swap_space.swap_in(request.request_id)
        tables = self.kv.get_block_tables(request.request_id)
        pairs = [(slot, tables[g][i]) for slot, (g, i) in zip(slots, self._swapped.pop(request.request_id), strict=True)
                 if tables[g][i] != self.kv.null_block]
        return [slot for slot, _ in pairs], [block for _, block in pairs]

    def _preempt(self, request: Request, preempted: set[str]) -> None:
        """Evict a running request: swap the written blocks it still holds out when swap space has room
        (it resumes with its ``num_computed_tokens``), else recompute (it restarts from token 0)."""
        self.running.remove(request)
        slots = None
        if self.swap_space is not None and request.num_computed_tokens:
            num_written = -(-request.num_computed_tokens // self.kv.block_size)
            held = [(g, i, block) for g, table in enumerate(self.kv.get_block_tables(request.request_id))
                    for i, block in enumerate(table[:num_written]) if block != self.kv.null_block]
            slots = self.swap_space.swap_out(request.request_id, len(held))
            if slots is not None:  # copied before this step's forward can reuse the freed blocks
                self._swap_out.append(([block for _, _, block in held], slots))
                self._swapped[request.request_id] = [(g, i) for g, i, _ in held]
        self.kv.free(request)  # frees while num_computed_tokens still counts the written tokens
        request.status = RequestStatus.PREEMPTED
        if slots is None:
            request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_parents = [], []  # drafts are re-proposed after re-admission
        request.num_preemptions += 1
        preempted.add(request.request_id)
        self.waiting.append(request)

    # ---- applying results -------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> tuple[list[Request], list[Request]]:
        """Advance computed tokens, append sampled tokens, check stops, free finished requests.

        Requests aborted between :meth:`schedule` and this call (or otherwise finished or unknown)
        are skipped: their sampled tokens are dropped and nothing of theirs is touched. Runner
        results for request ids that were not scheduled are ignored. Every request of the batch leaves
        :attr:`in_flight` (the next ``schedule()`` may run it again).

        Returns:
            ``(updated, finished)``: requests that got new tokens this step, and those of them
            that finished (their blocks are already freed).
        """
        if self.swap_space is not None:
            self.swap_space.end_step()  # the runner has copied this step's swap-ins
        now = self.clock.now()
        updated: list[Request] = []
        finished: list[Request] = []
        load_failures, loaded = (self.kv_transfer.update(scheduler_output, runner_output.kv_connector_output)
                                 if self.kv_transfer is not None else ({}, []))
        for request, failure in loaded:  # asynchronous loads done: back in the queue, holding their blocks
            self.waiting.append(request)
            if failure is not None and self.kv_transfer.load_failure_policy == "fail":
                self._record_load_failure(request, failure)
        for request in scheduler_output.scheduled_requests:
            self.in_flight.discard(request.request_id)
            if request.is_finished or self.requests.get(request.request_id) is not request:
                continue  # aborted (or finished) after schedule(): its blocks are gone, drop its results
            rid = request.request_id
            if rid in load_failures:  # its step ran over K/V that never arrived: its results are dropped
                self.kv_transfer.rewind(request, load_failures[rid])  # recompute from the first bad block
                if self.kv_transfer.load_failure_policy == "fail":
                    self._record_load_failure(request, load_failures[rid])
                continue
            # speculative decoding: only accepted drafts count as computed; the KV of rejected
            # positions is overwritten by later steps
            num_rejected = (len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
                            - runner_output.num_accepted_tokens.get(rid, 0))
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[rid] - num_rejected
            request.spec_token_ids, request.spec_parents = [], []
            if rid in runner_output.prompt_logprobs:
                self._add_prompt_logprobs(request, *runner_output.prompt_logprobs[rid])
            new_tokens = runner_output.sampled_token_ids.get(request.request_id)
            if not new_tokens:
                continue
            new_logprobs = runner_output.logprobs.get(request.request_id)
            for i, token_id in enumerate(new_tokens):
                request.append_output_token(token_id)
                if new_logprobs:
                    request.logprobs.append(new_logprobs[i])
                request.times.token_s.append(now)
                # a detokenizer/stop-check fault fails this request only (the engine aborts it after the update)
                if self.faults.call(rid, "stop checker (detokenizer, stop strings)", self.stop_checker.check, request,
                                    self.max_model_len, default=True):
                    break
            if request.times.first_token_s is None:
                request.times.first_token_s = now
            updated.append(request)
            if request.is_finished:
                self.running.remove(request)
                self._finish(request)
                finished.append(request)
        return updated, finished

    @staticmethod
    def _add_prompt_logprobs(request: Request, first_token: int, entries: list[dict[int, float]]) -> None:
        """Record prompt logprobs of tokens ``first_token ..``; positions already known (a prefill recomputed
        after a preemption) are skipped, so each prompt token has exactly one entry."""
        known = len(request.prompt_logprobs)
        request.prompt_logprobs.extend(entries[max(0, known - first_token):])

    def _record_load_failure(self, request: Request, failure: LoadFailure) -> None:
        """``load_failure_policy=fail``: the engine aborts the request after the update, with the error."""
        self.faults.record(request.request_id, f"kv_connector {self.kv_transfer.connector.name!r} load",
                           self.kv_transfer.failure_message(failure))

    def _finish(self, request: Request) -> None:
        held = False  # a KV connector still reads the blocks (delayed free): it frees them when it reports so
        if self.kv_transfer is not None:
            held, request.kv_transfer_params = self.kv_transfer.request_finished(
                request, self.kv.get_block_ids(request.request_id))
        if not held:
            self.kv.free(request)
        request.times.finished_s = self.clock.now()
        self.stop_checker.finalize(request)
        self.requests.pop(request.request_id, None)
        self._finished_ids.add(request.request_id)
