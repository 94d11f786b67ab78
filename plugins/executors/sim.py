"""``executor=sim``: the real engine (scheduler policies, KV allocators, preemption, prefix caching, grammars,
speculative-decoding bookkeeping) over a simulated model that loads no weights.

``execute_model(SchedulerOutput)`` predicts the step's time from its features (``framework/sim``: a
regression fit on a measured profile, an analytic roofline, or a recorded run) and returns synthetic
tokens (``framework.sim.outputs``). Everything around it is the engine's own code, so the decisions
(who runs, preemptions, prefix hits) are the ones the real engine takes for the same steps; only the
model's time and tokens are modelled (LLM-Emu's idea, Vidur's cost models). Parameters
(``executor.params``):

* ``clock``: ``virtual`` (default; the engine's clock advances by the predictions: 10,000 requests in
  seconds) or ``realtime`` (the step sleeps its predicted executor time: ``servelab serve`` and
  ``experiments/serving/bench_serving.py`` work against it unchanged);
* ``profile``: ``auto`` | ``analytic:<device>`` | ``replay:<file>`` | a profile file (``framework.sim.resolve``);
* ``eos_probability``: ``null`` (requests run to ``max_tokens``) or the chance of EOS per token;
* ``acceptance``: for ``spec_decode`` runs, a rate, per-position rates, ``{drafter: rate}`` or a metrics.json;
* ``draft_step_s``: the drafter's time per draft position of a step (a draft model's forward), seconds;
* ``grammar_mask_s``: ``auto`` (the profile's measured cost per bitmask row; else one timed on this machine
  at start-up) or seconds per structured-output row, added to virtual steps (real-time steps pay it for real);
* ``memory``: ``auto`` (an analytic device's memory: ``gpu_memory_utilization`` of it minus weights and
  activations; a measured profile: the engine's ``kv_cache_memory_bytes`` rule) or ``engine``;
* ``gpu_memory_utilization``: vLLM's knob for analytic devices; ``seed``: synthetic tokens' seed
  (``null``: the engine's ``seed``);
* ``pp_microbatches``: with ``parallel.pipeline_parallel_size=k``, microbatches per step (0: ``k``);
  ``expert_skew`` (busiest expert-parallel rank's load over the mean, >= 1) or ``expert_loads`` (tokens per expert)
  with ``parallel.enable_expert_parallel=true`` (``framework/sim/parallel_cost.py``, analytic profiles only);
* ``lora_device``: with ``lora.enable=true``, the ``framework.sim.roofline`` device whose peak and bandwidth price
  LoRA's adapter loads and shrink/expand FLOPs (``framework/sim/lora_cost.py``), added to every step; ``auto``:
  the analytic profile's device (a measured profile needs it named);
* ``offload_cpu_bandwidth_gbps``, ``offload_disk_bandwidth_gbps``: with ``kv_connector=offload``, each tier's
  bandwidth in Gbit/s; the tiers' hits, misses and LRU are the real connector's (``plugins/executors/_sim_offload.py``).

``parallel.tensor_parallel_size`` is the simulated TP degree (per-rank heads in the memory model, collectives in
the roofline); ``parallel.pipeline_parallel_size`` and ``parallel.enable_expert_parallel`` add pipeline bubbles and
hand-offs, all-to-all bytes and expert imbalance (analytic profiles). One executor is one replica with its own virtual clock; a router over several replicas (a later
issue) is a discrete-event loop over their engines: step the busy replica whose clock reads earliest, hand an
arrival at time t to a replica after ``engine.clock.sleep_until(t)`` if it idles (docs/decisions/simulator.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from framework import hookimpl
from framework.config import EngineConfig
from framework.core.clock import WALL_CLOCK, VirtualClock
from framework.core.outputs import ModelRunnerOutput, SchedulerOutput
from framework.hookspecs import Register
from framework.interfaces import Drafter, Executor, WorkerError
from framework.sim.features import step_features
from framework.sim.outputs import AcceptanceModel, SyntheticSampler
from framework.sim.resolve import check_profile_spec

logger = logging.getLogger(__name__)

CLOCKS = ("virtual", "realtime")
MEMORY_MODES = ("auto", "engine")
PARAMS = ("clock", "profile", "eos_probability", "acceptance", "draft_step_s", "grammar_mask_s", "memory",
          "gpu_memory_utilization", "seed", "lora_device", "pp_microbatches", "expert_skew", "expert_loads",
          "offload_cpu_bandwidth_gbps", "offload_disk_bandwidth_gbps")
KV_CONNECTORS = ("none", "offload")  # simulated worker sides (P/D has its own front: _sim_disagg.py)


class SimExecutor(Executor):
    """A simulated replica: predicted step times, synthetic tokens, the simulated device's KV memory.

    Raises:
        ValueError: a bad parameter (from :meth:`validate`, before anything loads), or a profile that cannot
            be found or measured.
    """

    name = "sim"

    def __init__(self, config: EngineConfig, clock: str = "virtual", profile: str = "auto",
                 eos_probability: float | None = None, acceptance: Any = None, draft_step_s: float = 0.0,
                 grammar_mask_s: str | float = "auto", memory: str = "auto", gpu_memory_utilization: float = 0.9,
                 seed: int | None = None, lora_device: str = "auto", pp_microbatches: int = 0,
                 expert_skew: float = 1.0, expert_loads: list[float] | None = None,
                 offload_cpu_bandwidth_gbps: float | None = None, offload_disk_bandwidth_gbps: float | None = None
                 ) -> None:
        # pp_microbatches, expert_skew, expert_loads: read by the analytic roofline from config.executor_params
        super().__init__(config, clock=clock, profile=profile)
        import torch

        from framework.model_executor.model_loader import load_model_config
        from framework.sim.resolve import resolve_predictor

        self.hf_config = load_model_config(config.model)
        self.predictor, self.profile = resolve_predictor(str(profile), config, self.hf_config,
                                                         torch.get_num_threads(), _measure_with_progress)
        self.clock = VirtualClock() if clock == "virtual" else WALL_CLOCK
        self.sampler = SyntheticSampler(self.hf_config.vocab_size, config.seed if seed is None else int(seed),
                                        eos_probability)
        self.acceptance_param = acceptance
        self.acceptance: AcceptanceModel | None = None  # set when a drafter is simulated
        self.num_drafts = 0
        self.draft_step_s = float(draft_step_s)
        self.grammar_mask_s_param = grammar_mask_s
        self.grammar_mask_s: float | None = None  # resolved on the first constrained step
        from plugins.executors._sim_rank import SimRank

        self.lora_cost = _lora_cost(config, self.hf_config, lora_device) if config.enable_lora else None
        self.rank = SimRank(config, self.hf_config, self.profile, self.predictor.source, memory,
                            float(gpu_memory_utilization))
        from plugins.executors._sim_offload import simulated_offload

        self.offload = simulated_offload(config, self.rank.kv_cache_bytes_per_block(), offload_cpu_bandwidth_gbps,
                                         offload_disk_bandwidth_gbps)
        logger.info("executor=sim: clock=%s, step times from %s, no weights loaded", clock, self.predictor.source)

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Parameter names and values (before anything loads)."""
        problems = super().validate(config)
        params = config.executor_params
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            problems.append(f"executor=sim: unknown params {unknown}; valid: {', '.join(PARAMS)}")
        if params.get("clock", "virtual") not in CLOCKS:
            problems.append(f"executor.params.clock must be virtual or realtime, got {params.get('clock')!r}")
        if params.get("memory", "auto") not in MEMORY_MODES:
            problems.append(f"executor.params.memory must be auto or engine, got {params.get('memory')!r}")
        mask = params.get("grammar_mask_s", "auto")
        if mask != "auto" and not (isinstance(mask, (int, float)) and mask >= 0):
            problems.append(f"executor.params.grammar_mask_s must be auto or seconds >= 0, got {mask!r}")
        if not 0 < float(params.get("gpu_memory_utilization", 0.9)) <= 1:
            problems.append("executor.params.gpu_memory_utilization must be in (0, 1]")
        if float(params.get("draft_step_s", 0.0)) < 0:
            problems.append("executor.params.draft_step_s must be >= 0 seconds")
        if (config.enable_lora and params.get("lora_device", "auto") == "auto"
                and not str(params.get("profile", "auto")).startswith("analytic:")):
            problems.append("executor=sim with lora.enable=true prices adapter loads and LoRA FLOPs on a roofline "
                            "device: set executor.params.lora_device=<h100|h200|a100|l4> or "
                            "executor.params.profile=analytic:<device>")
        analytic = str(params.get("profile", "auto")).startswith("analytic:")
        if (config.pipeline_parallel_size > 1 or config.enable_expert_parallel) and not analytic:
            problems.append("executor=sim prices parallel.pipeline_parallel_size > 1 and parallel.enable_expert_parallel "
                            "in its analytic profiles only: set executor.params.profile=analytic:<device>")
        if config.kv_connector not in KV_CONNECTORS:
            problems.append(f"executor=sim simulates kv_connector={'|'.join(KV_CONNECTORS)}, not "
                            f"{config.kv_connector!r} (P/D: disagg.prefill_replicas=P with kv_connector=none)")
        for name in ("offload_cpu_bandwidth_gbps", "offload_disk_bandwidth_gbps"):
            if params.get(name) is not None and not float(params[name]) > 0:
                problems.append(f"executor.params.{name} must be > 0 Gbit/s (or null: the default)")
        if int(params.get("pp_microbatches", 0)) < 0:
            problems.append("executor.params.pp_microbatches must be >= 0 (0: one per pipeline stage)")
        problem = check_profile_spec(params.get("profile", "auto"))
        return problems + ([problem] if problem else [])

    @classmethod
    def wall_clock(cls, config: EngineConfig) -> bool:
        """``executor.params.clock=realtime`` only (the default ``virtual`` clock jumps by each step's prediction)."""
        return config.executor_params.get("clock", "virtual") == "realtime"

    @classmethod
    def build_disaggregated_front(cls, config: EngineConfig, metrics: Any = None) -> Any:
        """``build_engine``'s front for ``disagg.prefill_replicas > 0``: the simulated prefill and decode pools
        (``plugins/executors/_sim_disagg.py``: ``build_disaggregated_sim_engine``).

        Raises:
            ValueError: bad ``kv_transfer.params`` (naming the key).
        """
        from plugins.executors._sim_disagg import build_disaggregated_sim_engine

        return build_disaggregated_sim_engine(config, metrics)

    # ---- the executor verbs --------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, unique_reply_rank: int | None = None) -> list[Any]:
        """Call the simulated rank's ``method`` (``framework``'s rank verbs: memory, cache, compile stats).

        Raises:
            WorkerError: the simulated rank has no such method.
        """
        target = getattr(self.rank, method, None)
        if target is None:
            raise WorkerError(f"executor=sim: the simulated rank has no method {method!r}")
        return [target(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Predict the step's time, let it pass (virtual: advance the clock by the whole step; realtime:
        sleep the executor's share, the rest being the engine's own work), return synthetic tokens."""
        start = time.perf_counter()
        offload_s = (self.offload.start_step(scheduler_output.kv_connector_metadata, self.clock.now())
                     if self.offload is not None else 0.0)
        if scheduler_output.total_num_scheduled_tokens == 0 and not (scheduler_output.swap_out
                                                                      or scheduler_output.swap_in):
            out = ModelRunnerOutput(sampled_token_ids={})  # only finished ids, or polling parked loads: no forward
            if self.offload is not None:
                self._wait_for_offload(offload_s)
                out.kv_connector_output = self.offload.finish_step(self.clock.now())
            return out
        features = step_features(scheduler_output, self.config.block_size, _remote_prefills(scheduler_output))
        predicted = self.predictor.predict(features)
        extra_s = self.draft_step_s * self.num_drafts if scheduler_output.scheduled_spec_decode_tokens else 0.0
        extra_s += offload_s
        if self.lora_cost is not None:
            requests = scheduler_output.scheduled_requests
            extra_s += self.lora_cost.step_s([r.lora_request for r in requests],
                                             [scheduler_output.num_scheduled_tokens[r.request_id] for r in requests])
        out = self._sample(scheduler_output)
        if isinstance(self.clock, VirtualClock):
            if features.num_constrained_rows:
                extra_s += self._mask_cost_s() * features.num_constrained_rows
            self.clock.advance(predicted.step_s + extra_s)
        else:
            time.sleep(max(0.0, start + predicted.execute_s + extra_s - time.perf_counter()))
        out.forward_s = predicted.execute_s + extra_s
        if self.offload is not None:
            out.kv_connector_output = self.offload.finish_step(self.clock.now())
        return out

    def _wait_for_offload(self, offload_s: float) -> None:
        """A step with nothing to run: let its synchronous moves pass, then time up to the earliest parked request's
        loads completing (an arrival meanwhile is admitted at the end of the wait, its TTFT counting the wait: a
        simplification: nothing else runs meanwhile)."""
        ready_s = self.offload.next_ready_s()
        until_s = self.clock.now() + offload_s
        if ready_s is not None:
            until_s = max(until_s, ready_s)
        if isinstance(self.clock, VirtualClock):
            self.clock.advance(max(0.0, until_s - self.clock.now()))
        else:
            time.sleep(max(0.0, until_s - self.clock.now()))

    def _sample(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Synthetic tokens of every request whose scheduled tokens reach its end: accepted drafts plus one."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[dict[int, float]]] = {}
        accepted: dict[str, int] = {}
        rows = so.structured_output_request_ids
        for request in so.scheduled_requests:
            rid = request.request_id
            if request.num_computed_tokens + so.num_scheduled_tokens[rid] < request.num_tokens:
                continue  # a prefill chunk short of the prompt's end samples nothing
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            num_accepted = self.acceptance.num_accepted(len(drafts), self.sampler.rng) if drafts else 0
            tokens = list(drafts[:num_accepted])
            if rid in rows:
                tokens.append(self.sampler.allowed_token(so.grammar_bitmask[rows[rid] + num_accepted]))
            else:
                tokens.append(self.sampler.token(request, request.num_output_tokens + num_accepted))
            sampled[rid] = tokens
            if drafts:
                accepted[rid] = num_accepted
            num_logprobs = request.sampling_params.logprobs
            if num_logprobs is not None:
                logprobs[rid] = [self.sampler.logprobs(t, num_logprobs) for t in tokens]
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_accepted_tokens=accepted)

    def _mask_cost_s(self) -> float:
        """Seconds per structured-output bitmask row: the parameter, the profile's measured value, or (analytic
        and replay runs) one timed now on this machine with the run's grammar."""
        if self.grammar_mask_s is None:
            if self.grammar_mask_s_param != "auto":
                self.grammar_mask_s = float(self.grammar_mask_s_param)
            elif self.profile is not None and self.profile.grammar_mask_s_per_row is not None:
                self.grammar_mask_s = self.profile.grammar_mask_s_per_row
            else:
                from plugins.executors._sim_rank import time_grammar_mask

                self.grammar_mask_s = time_grammar_mask(self.config)
                logger.info("executor=sim: structured-output mask cost timed on this machine: %.1f us per row",
                            1e6 * self.grammar_mask_s)
        return self.grammar_mask_s

    def simulated_drafter(self, drafter: Drafter) -> Drafter:
        """A stand-in that proposes ``num_speculative_tokens`` synthetic drafts per decoding request; how many
        the target accepts comes from ``executor.params.acceptance``."""
        self.num_drafts = drafter.num_speculative_tokens
        self.acceptance = AcceptanceModel.from_param(self.acceptance_param, drafter.name, self.num_drafts)
        return SimulatedDrafter(drafter.name, self.num_drafts, self.sampler)

    def run_labels(self) -> dict[str, Any]:
        """``simulated: True`` and the step times' source (``measured:<model>@<device>``, ``analytic:<device>``,
        ``replay:<file>``)."""
        return {"simulated": True, "sim_profile": self.predictor.source}

    def check_health(self) -> None:
        """A simulated rank never dies."""

    def shutdown(self) -> None:
        """Nothing runs."""


def _remote_prefills(so: SchedulerOutput) -> dict[str, int] | None:
    """P/D decode requests (``kv_transfer_params["do_remote_prefill"]``, set by the simulated P/D front,
    ``plugins/executors/_sim_disagg.py``): request id -> prompt tokens whose K/V came from the prefill replica
    (all but the last, which the decode replica computes to sample its first token, as vLLM's decode side does)."""
    remote = {r.request_id: r.num_prompt_tokens - 1 for r in so.scheduled_requests
              if (r.sampling_params.kv_transfer_params or {}).get("do_remote_prefill")}
    return remote or None


def _lora_cost(config: EngineConfig, hf_config: Any, lora_device: str) -> Any:
    """The run's :class:`framework.sim.lora_cost.LoRAStepCost` (``lora_device=auto``: the analytic profile's)."""
    from framework.sim.lora_cost import LoRAStepCost
    from framework.sim.memory import DTYPE_BYTES

    if lora_device == "auto":
        lora_device = str(config.executor_params.get("profile", "")).removeprefix("analytic:")
    return LoRAStepCost(hf_config, DTYPE_BYTES.get(config.dtype, 2), config.max_loras, config.max_lora_rank,
                        lora_device, config.tensor_parallel_size)


class SimulatedDrafter(Drafter):
    """Stands in for drafter ``name`` in a simulated run: ``k`` synthetic (non-EOS) drafts for every request
    the engine asks about, so every decode step verifies ``k`` drafts (a real n-gram drafter proposes only
    where it finds a match: express that through a lower acceptance)."""

    def __init__(self, name: str, num_speculative_tokens: int, sampler: SyntheticSampler) -> None:
        super().__init__(num_speculative_tokens=num_speculative_tokens)
        self.name = f"{name} (simulated)"
        self.sampler = sampler

    def propose(self, requests: list[Any]) -> dict[str, list[int]]:
        """``num_speculative_tokens`` synthetic drafts per request."""
        return {r.request_id: self.sampler.draft(r, self.num_speculative_tokens) for r in requests}


def _measure_with_progress(config: EngineConfig) -> Any:
    """``profile=auto`` found no profile: measure one with the real engine, printing progress."""
    from framework.engine.profiler import GRIDS, Progress, measure_profile
    from framework.platform import cpu_isa

    print(f"executor=sim profile=auto: no profile of {config.model} on {cpu_isa().summary()} with these engine "
          f"settings (dtype={config.dtype}); measuring one with the real engine ({len(GRIDS['default'])} cells, "
          "minutes; each cell says when it is done), cached for later runs; `servelab profile` makes one ahead",
          flush=True)
    return measure_profile(config, "default", progress=Progress("  profile"))


@hookimpl
def register_executors(register: Register) -> None:
    """Register ``sim``."""
    register("sim", SimExecutor)
