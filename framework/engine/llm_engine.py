"""``LLMEngine``: one step = schedule -> execute -> update -> observe (vLLM V1 ``EngineCore``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from framework.compilation.calibration import CompilePlanner
from framework.compilation.policy import CompileDecision
from framework.config import EngineConfig
from framework.core.faults import RequestFailure
from framework.core.lora_request import LoRARequest
from framework.core.outputs import ModelRunnerOutput, RequestOutput, SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.structured_output import StructuredOutputManager
from framework.engine.batch_queue import BatchQueue
from framework.engine.compile_control import CompileControl
from framework.engine.draft_proposer import DraftProposer
from framework.engine.lora_support import LoRAAdmission
from framework.engine.output_processor import OutputProcessor, scheduler_stats
from framework.engine.parallel_sampling import ParallelRequests
from framework.engine.processor import Processor
from framework.engine.structured_output_gate import StructuredOutputGate
from framework.interfaces import Drafter, EngineDeadError, Executor, KVAllocator, ReplicaState
from framework.interfaces.engine import ReplicaView
from framework.metrics.collector import MetricsCollector


class LLMEngine:
    """The engine loop. Build it with :func:`framework.engine.builder.build_llm_engine`
    (one replica) or :func:`framework.build_engine` (any front).

    The engine (the driver) talks to the scheduler and the executor only; the scheduler owns the
    KV allocator and the policy, the executor runs the worker ranks, which own the model, the KV
    tensors and the sampler.

    When the executor loses a worker, :meth:`step` finishes every in-flight request with the error
    (``finish_reason="abort"``, ``error`` set; ``on_request_finished`` fires for each) and raises
    :class:`~framework.interfaces.EngineDeadError`, whose ``outputs`` holds those final outputs;
    the engine then refuses new requests.

    Per-request faults (``framework.core.faults``): the scheduler's ``RequestFaults`` is shared with the
    structured-output manager and the engine's drafter calls; the requests it holds are aborted with
    their error at fixed points of :meth:`step`. Anything else that raises in :meth:`step` leaves the
    engine's state unknown: callers treat it as fatal (``EngineDeadError``).
    """

    def __init__(self, config: EngineConfig, scheduler: Scheduler, executor: Executor, tokenizer: Any,
                 eos_token_ids: frozenset[int], vocab_size: int, metrics: MetricsCollector | None = None,
                 structured_output: StructuredOutputManager | None = None,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter
        self.scheduler = scheduler
        self.executor = executor
        self.batches = BatchQueue(executor)  # batches in flight: up to executor.max_concurrent_batches
        self.clock = executor.clock  # wall time, or a simulator's virtual time: every timestamp of the run
        # bytes of one KV block over all ranks (each rank holds its own copy or shard): swap traffic and
        # the per-request KV metrics
        self.block_bytes = executor.kv_cache_bytes_per_block() * config.tensor_parallel_size
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = scheduler.max_model_len
        self.metrics = metrics or MetricsCollector()
        self.metrics.clock = self.clock
        self.metrics.run_labels = executor.run_labels()  # simulated or not, in every record
        self.num_steps = 0
        self.structured_output = structured_output  # the grammar manager (EngineClient), or None
        self.parallel = ParallelRequests()  # n > 1 requests and their sequences
        self.processor = Processor(tokenizer, vocab_size, self.max_model_len, eos_token_ids,
                                   structured_output is not None, self.clock,
                                   LoRAAdmission(config).check if config.enable_lora else None)
        self.output_processor = OutputProcessor(self.block_bytes, self.metrics)
        self.compile = CompileControl(config, executor, self.metrics, scheduler)
        self.faults = scheduler.faults  # one record of per-request failures for every per-request call site
        # structured requests wait here (outside the scheduler) while their grammar compiles
        self.grammars = StructuredOutputGate(structured_output, scheduler, self.faults, self.clock)
        self.proposer = (DraftProposer(drafter, scheduler, self.faults, self.clock, vocab_size, self.max_model_len,
                                       structured_output) if drafter is not None else None)

    # ---- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, client_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate and queue one request; with ``sampling_params.n > 1``, its ``n`` sequences (child requests
        ``"{i}_{request_id}"``, seeds ``seed + i``; their outputs come back merged under ``request_id``,
        ``framework/engine/parallel_sampling.py``).

        Args:
            prompt: text (tokenized with the model's tokenizer, special tokens added) or token ids.
            arrival_time: seconds on the engine's clock (``self.clock``: ``time.perf_counter`` unless a
                simulator's); default now.
            client_id: the sender, for fair-share policies (``scheduler=fair``).
            lora_request: the LoRA adapter it runs under (``None``: the base model; needs ``enable_lora``).

        Raises:
            ValueError: empty prompt, token id (prompt or ``logit_bias``) outside the vocabulary, prompt
                longer than ``max_model_len``, duplicate ``request_id``, invalid sampling params or a LoRA adapter
                that cannot be served (``framework/engine/lora_support.py``). Nothing is queued and engine state
                is unchanged.
            EngineDeadError: the executor lost a worker earlier.
        """
        if self.executor.dead is not None:
            raise EngineDeadError(f"the engine is dead ({self.executor.dead}); build a new one")
        parent, requests = self.processor.process(request_id, prompt, sampling_params, priority, arrival_time,
                                                  client_id, self._in_use, lora_request)
        if parent is not None:
            self.parallel.add(parent)
        for request in requests:
            if not self.grammars.submit(request):  # held while its grammar compiles
                self.scheduler.add_request(request)

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or request_id in self.grammars or request_id in self.parallel

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt``, checked against the vocabulary and ``max_model_len`` (``Processor.tokenize``).

        Raises:
            ValueError: see :meth:`add_request`.
        """
        return self.processor.tokenize(prompt)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort running or waiting requests at any point between or inside steps.

        Their blocks are freed at once; tokens a runner already sampled for them in the current
        step are dropped by the scheduler. Unknown or already finished ids are ignored.

        Returns:
            One final ``RequestOutput`` per aborted request (``finished=True``,
            ``finish_reason="abort"``, the tokens produced so far). ``step()`` does not repeat them.
        """
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = self.parallel.expand(ids)
        outputs = [self.output_processor.report_finished(r) for r in self.grammars.fail(ids, None)]
        return self._to_caller(outputs + self._abort(ids))

    def _abort(self, ids: list[str], failures: dict[str, RequestFailure] | None = None) -> list[RequestOutput]:
        """Abort scheduler requests (``failures``: why some failed); their drafter state and matchers are
        dropped now. Returns their final outputs."""
        aborted = self.scheduler.abort_requests(ids, failures)
        if self.proposer is not None and aborted:  # drop drafter state now, not at the next step
            self.proposer.call("on_requests_freed", {r.request_id for r in aborted})
        for request in aborted:
            self.grammars.discard(request.request_id)
        return [self.output_processor.report_finished(request) for request in aborted]

    def _abort_failed(self) -> list[RequestOutput]:
        """Abort the requests a per-request call site failed on (``self.faults``); everything else runs on."""
        failures = self.faults.take()
        return self._abort(list(failures), failures) if failures else []

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running, or a batch is in flight (its output is still to apply,
        even when all its requests were aborted)."""
        return self.scheduler.has_unfinished_requests() or bool(self.grammars) or bool(self.batches)

    def replica_state(self, replica_id: int) -> ReplicaState:
        """This engine's load as a data-parallel replica (``framework.interfaces.router``): waiting requests
        (incl. those whose grammar compiles), running ones and the fraction of KV blocks in use, now."""
        kv = self.scheduler.kv
        return ReplicaState(replica_id=replica_id, num_waiting_reqs=self.scheduler.num_waiting + len(self.grammars),
                            num_running_reqs=len(self.scheduler.running),
                            kv_cache_usage=1.0 - kv.num_free_blocks / kv.num_blocks if kv.num_blocks else 0.0,
                            published_s=self.clock.now())

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """``ReplicaEngine.lora_adapters``: adapter names of the running and of the waiting requests, sorted."""
        def names(requests: Sequence[Request]) -> list[str]:
            return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

        return names(self.scheduler.running), names(self.scheduler.waiting)

    def replica_views(self) -> list[ReplicaView]:
        """``EngineClient.replica_views``: this engine alone, alive, nothing routed."""
        return [ReplicaView(self, True, 0)]

    def fail_unfinished(self, error: str) -> list[RequestOutput]:
        """Finish every unfinished request as aborted with ``error`` (a data-parallel front removing this
        replica after its step raised); returns their final outputs, as the caller sees them."""
        return self._to_caller(self._fail_all(error))

    # ---- compilation ------------------------------------------------------------------
    def maybe_compile(self, planned_budgets: Sequence[int] | None, repeats: int = 1) -> CompileDecision:
        """``engine.compile=auto``: compile the decoder now if the work about to start saves more than the
        compile costs on this machine (the rule: :meth:`CompileControl.maybe_compile`). Entry points call it
        before adding work: ``LLM.generate`` and the offline runner with their requests' output-token budgets,
        the server with ``None``; ``repeats``: that work runs this many times in a row.

        Returns:
            The decision in force (also in ``metrics.json`` as ``compile_reason``, ``compile_estimate``).
        """
        return self.compile.maybe_compile(planned_budgets, repeats)

    @property
    def compile_decision(self) -> CompileDecision:
        """The ``engine.compile`` decision in force (``metrics.json``'s ``compile_reason``)."""
        return self.compile.decision

    @property
    def compile_planner(self) -> CompilePlanner:
        """``engine.compile=auto``'s measured numbers for this machine and model."""
        return self.compile.planner

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step: schedule and submit a batch while the batch queue has room
        (``framework.engine.batch_queue``; one batch unless the executor runs several at once), else, or
        when nothing new could be scheduled, wait for the oldest batch in flight and apply its output.

        Returns:
            A ``RequestOutput`` for each request that produced tokens this step (finished
            ones with ``finished=True``, final ``text`` and ``metrics``); empty when the step only submitted.

        Raises:
            EngineDeadError: the executor lost a worker; every in-flight request was finished with
                the error first (their final outputs are ``error.outputs``).
        """
        t0 = self.clock.now()
        failed = [self.output_processor.report_finished(r) for r in self.grammars.admit()]
        failed += self._abort_failed()  # the grammar plugin raised: start recorded a fault
        idle = None  # an empty schedule while nothing is in flight: applied at once, as a step with no forward
        try:
            if self.executor.dead is not None:
                raise self.executor.dead
            if not self.batches.full:
                sched_out = self.scheduler.schedule()
                self.grammars.fill_bitmask(sched_out)
                if not (sched_out.reaches_workers or self.scheduler.kv_transfers_in_flight):
                    idle = None if self.batches else (sched_out, ModelRunnerOutput(sampled_token_ids={}),
                                                      (t0, self.clock.now()))
                else:  # finished or preempted ids alone still go out: the workers drop or re-table those requests
                    self.batches.submit(sched_out, (t0, self.clock.now()))
                    if not self.batches.full:  # room for another batch: the next step schedules it
                        return self._to_caller(failed)
            done = idle or self.batches.pop_oldest()
        except EngineDeadError as error:
            self.batches.clear()
            error.outputs = self._to_caller(failed + self._fail_all(str(error)))
            self.executor.shutdown()
            raise
        return self._to_caller(failed + self._apply(*done))

    def _apply(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
               times: tuple[float, float]) -> list[RequestOutput]:
        """Apply one batch's output: update the scheduler, grammars and drafter, emit outputs and the step's stats
        (``times``: the batch's step start and schedule end)."""
        t0, t1 = times
        t2 = self.clock.now()
        failed = []
        for request_id, (what, detail) in runner_out.request_errors.items():  # the worker's per-request sites
            self.faults.record(request_id, what, detail)
        failed += self._abort_failed()  # a grammar matcher failed in the bitmask: its sampled token is dropped
        updated, _ = self.scheduler.update_from_output(sched_out, runner_out)
        self.grammars.advance(updated)
        failed += self._abort_failed()  # detokenizer/stop checker or grammar matcher failed on the new tokens
        t3 = self.clock.now()
        draft_s = self.proposer.propose(sched_out, runner_out, updated) if self.proposer is not None else 0.0
        failed += self._abort_failed()  # the drafter failed on a request
        gone = {o.request_id for o in failed}
        updated = [r for r in updated if r.request_id not in gone]
        outputs = failed + [self.output_processor.make_output(r) for r in updated]
        if not sched_out.is_empty:  # the step's stats to the metrics and hooks; its decode shape to engine.compile
            stats = scheduler_stats(self.num_steps, self.scheduler, sched_out, runner_out, len(updated),
                                    (t0, t1, t2, t3), draft_s, self.block_bytes)
            self.num_steps += 1
            self.compile.observe_step(stats, t2 - t1, self.clock.realtime)
            self.output_processor.observe_step(stats, sched_out, runner_out)
        for request, output in zip(updated, outputs[len(failed):]):
            if request.is_finished:
                self.output_processor.observe_finished(output)
        if not self.scheduler.has_unfinished_requests():
            self.compile.planner.flush_observed(force=False)
        return [o for o in outputs if o is not None]

    def _to_caller(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Outputs as the caller sees them: a parallel-sampling request's sequences merged into its own."""
        return self.parallel.to_caller(outputs)

    def check_health(self) -> None:
        """Raise :class:`~framework.interfaces.EngineDeadError` when the executor lost a worker."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the workers and the grammar compile threads; idempotent. Requests still in flight
        are not finished (abort them first)."""
        self.compile.planner.flush_observed()
        self.executor.shutdown()
        self.grammars.shutdown()

    def _fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every unfinished request as aborted with ``error`` (the executor is dead)."""
        ids = list(self.scheduler.requests)
        held = self.grammars.fail(None, error)
        outputs = [self.output_processor.report_finished(r) for r in held]
        for request in self.scheduler.abort_requests(ids):
            request.error = error
            self.grammars.discard(request.request_id)
            outputs.append(self.output_processor.report_finished(request))
        return outputs

    @property
    def runner(self) -> Any:
        """The model runner of an in-process executor (``uniproc``), for inspection and experiments.

        Raises:
            AttributeError: the executor runs its ranks in other processes.
        """
        runner = getattr(self.executor, "runner", None)
        if runner is None:
            raise AttributeError(f"executor={self.config.executor} runs its model runners in worker processes; "
                                 "use engine.executor.collective_rpc(...) (or executor=uniproc to inspect one)")
        return runner

    @property
    def kv_allocator(self) -> KVAllocator:
        """The KV allocator (for inspection and tests)."""
        return self.scheduler.kv

