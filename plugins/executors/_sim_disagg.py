"""P/D disaggregation under ``executor=sim``: a prefill pool and a decode pool of simulated replicas, with the KV
transfer between them priced from its bytes (DistServe, Zhong et al., OSDI'24, Sec. 2-3: prefill and decode on
separate instances, so each phase's batch serves its own SLO; vLLM's disaggregated-prefill proxy contract).

With ``disagg.prefill_replicas=P`` and ``parallel.data_parallel_size=N``, :func:`build_disaggregated_sim_engine`
builds ``P`` prefill replicas and ``N - P`` decode replicas (each a ``DataParallelEngine`` with its own router:
routers pick within each pool). A request

1. prefills on a prefill replica with one output token (``framework.engine.async_llm.prefill_params``: vLLM's
   proxy's ``max_tokens=1`` request, ``do_remote_decode``);
2. its prompt's K/V moves to the decode pool in ``latency_s + num_prompt_tokens * kv_bytes_per_token * 8 /
   (bandwidth_gbps * 1e9)`` seconds (``kv_transfer.params``: ``bandwidth_gbps`` Gbit/s of the replica-to-replica
   link, all its ranks' shards together, default :data:`DEFAULT_BANDWIDTH_GBPS`; ``latency_s`` default
   :data:`DEFAULT_LATENCY_S`; ``kv_bytes_per_token`` of every rank, from ``framework.sim.memory``); transfers do
   not contend for the link;
3. decodes on a decode replica with its own ``SamplingParams`` and ``do_remote_prefill``: the decode replica
   allocates the prompt's blocks but computes only its last token (``framework.sim.features.step_features``'s
   ``loaded``), as vLLM's decode side loads all but the last token and samples the first output token itself.

TTFT is measured on the decode replica from the original arrival, so it counts prefill queueing, prefill,
transfer, decode queueing and the first decode step (what a client of vLLM's proxy sees). Time is a
discrete-event loop: the earliest of (a busy replica's clock, a transfer's arrival) goes next, as
``DataParallelEngine`` steps its earliest replica. A recompute preemption on a decode replica recomputes only the
last prompt token (the transferred K/V is assumed kept: an optimistic simplification).

With ``kv_connector=offload`` the prefill replicas carry the offload tiers (``plugins/executors/_sim_offload.py``:
LMCache's P/D set-up, where the prefiller offloads and a later turn's prompt loads its earlier turns from the CPU
or disk tier instead of recomputing them); the decode replicas have none (every prompt reaches them by transfer).
The front's ``metrics`` combine both pools' replicas (each summary with its ``role``), so ``external_prefix_cache_hits``
counts the prefill pool's tier hits.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from typing import Any

from framework.config import EngineConfig
from framework.core.clock import Clock
from framework.core.lora_request import LoRARequest
from framework.core.outputs import RequestOutput
from framework.core.sampling_params import SamplingParams
from framework.engine.async_llm import prefill_params
from framework.engine.data_parallel import DataParallelEngine, build_data_parallel_engine
from framework.engine.dp_metrics import DataParallelMetrics
from framework.entrypoints.engine import build_engine
from framework.metrics.collector import MetricsCollector

DEFAULT_BANDWIDTH_GBPS = 400.0  # Gbit/s: one 400G NIC's worth per replica (InfiniBand NDR / 400GbE)
DEFAULT_LATENCY_S = 1e-3  # per transfer: connection set-up and the first byte, seconds
LINK_PARAMS = ("bandwidth_gbps", "latency_s")


def transfer_s(num_tokens: int, kv_bytes_per_token: float, bandwidth_gbps: float, latency_s: float) -> float:
    """Seconds to move ``num_tokens`` tokens' K/V (``kv_bytes_per_token`` bytes each, all ranks) over a link of
    ``bandwidth_gbps`` Gbit/s after ``latency_s``."""
    return latency_s + num_tokens * kv_bytes_per_token * 8 / (bandwidth_gbps * 1e9)


def link_params(config: EngineConfig) -> tuple[float, float]:
    """``(bandwidth_gbps, latency_s)`` of ``kv_transfer.params``.

    Raises:
        ValueError: an unknown key, a bandwidth <= 0 or a negative latency (naming the key).
    """
    params = config.kv_transfer_link_params
    unknown = sorted(set(params) - set(LINK_PARAMS))
    if unknown:
        raise ValueError(f"unknown kv_transfer.params {unknown}; executor=sim reads {', '.join(LINK_PARAMS)}")
    bandwidth = float(params.get("bandwidth_gbps", DEFAULT_BANDWIDTH_GBPS))
    latency = float(params.get("latency_s", DEFAULT_LATENCY_S))
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"kv_transfer.params.bandwidth_gbps must be > 0 and latency_s >= 0, got {bandwidth}, {latency}")
    return bandwidth, latency


class DisaggregatedClock(Clock):
    """The front's time: the earliest busy replica's clock or in-flight transfer's arrival, else the latest clock."""

    realtime = False

    def __init__(self, front: DisaggregatedSimEngine) -> None:
        self.front = front

    def now(self) -> float:
        """Seconds (virtual)."""
        times = [t for t, _ in self.front.next_events()]
        return min(times) if times else max(r.clock.now() for r in self.front.all_replicas())

    def sleep_until(self, t_s: float) -> None:
        """Idle replicas jump to ``t_s``."""
        for replica in self.front.all_replicas():
            if not replica.has_unfinished_requests():
                replica.clock.sleep_until(t_s)


class DisaggregatedSimEngine:
    """A prefill pool and a decode pool behind the engine interface (see the module docstring).

    Args:
        config: the front's config (``data_parallel_size`` = both pools, ``disagg_prefill_replicas`` = prefill).
        prefill, decode: the pools.
        kv_bytes_per_token: K/V bytes of one token over all of a replica's ranks.
    """

    def __init__(self, config: EngineConfig, prefill: DataParallelEngine, decode: DataParallelEngine,
                 kv_bytes_per_token: float) -> None:
        self.config, self.prefill, self.decode = config, prefill, decode
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth_gbps, self.latency_s = link_params(config)
        self.tokenizer, self.vocab_size, self.eos_token_ids = decode.tokenizer, decode.vocab_size, decode.eos_token_ids
        self.max_model_len, self.structured_output = decode.max_model_len, decode.structured_output
        # the front's collector sees each request once, finished on its decode replica; step-level numbers (steps,
        # prefix and external prefix-cache hits, preemptions) combine both pools' replicas
        self.metrics = DataParallelMetrics.over_pools(
            decode.metrics.front, [(prefill.replicas, prefill.replica_set, "prefill"),
                                   (decode.replicas, decode.replica_set, "decode")], config.router)
        self.clock = DisaggregatedClock(self)
        self.metrics.front.clock = self.clock
        self.compile_decision = decode.compile_decision
        self._originals: dict[str, tuple[SamplingParams, float, dict[str, Any]]] = {}
        self._transfers: list[tuple[float, int, str, list[int]]] = []  # (arrival at decode, seq, id, prompt ids)
        self._seq = 0
        self.transfer_s_total = 0.0  # seconds of KV transfer over the run's requests (a study reports the mean)
        self.num_transfers = 0

    def all_replicas(self) -> list[Any]:
        """Every replica of both pools."""
        return [*self.prefill.replicas, *self.decode.replicas]

    def next_events(self) -> list[tuple[float, str]]:
        """``(time, kind)`` of each busy replica (``prefill``/``decode``) and the earliest transfer."""
        events = [(r.clock.now(), "prefill") for r in self.prefill.replicas if r.has_unfinished_requests()]
        events += [(r.clock.now(), "decode") for r in self.decode.replicas if r.has_unfinished_requests()]
        if self._transfers:
            events.append((self._transfers[0][0], "transfer"))
        return events

    def has_unfinished_requests(self) -> bool:
        """True while a request prefills, transfers or decodes."""
        return bool(self._transfers) or self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, client_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue the request's prefill on the prefill pool (``LLMEngine.add_request``'s arguments).

        Raises:
            ValueError: a bad prompt or params, or a LoRA request (P/D with LoRA is not simulated).
        """
        if lora_request is not None:
            raise ValueError("executor=sim's P/D front does not simulate LoRA adapters; drop lora or disagg")
        params = sampling_params or SamplingParams()
        arrival = self.clock.now() if arrival_time is None else arrival_time
        self.prefill.add_request(request_id, prompt, prefill_params(params), priority=priority, arrival_time=arrival,
                                 client_id=client_id)
        self._originals[request_id] = (params, arrival, {"priority": priority, "client_id": client_id})

    def step(self) -> list[RequestOutput]:
        """Advance the earliest event: deliver a transfer to the decode pool, or step a pool's earliest replica.
        Returns the decode pool's outputs, and prefill outputs that end their request (one token, EOS, errors)."""
        events = self.next_events()
        if not events:
            return []
        when, kind = min(events, key=lambda e: (e[0], e[1] != "transfer"))
        if kind == "transfer":
            self._deliver(when)
            return []
        if kind == "decode":
            return self.decode.step()
        finished: list[RequestOutput] = []
        for output in self.prefill.step():
            if output.finished:
                finished += self._prefilled(output)
        return finished

    def _prefilled(self, output: RequestOutput) -> list[RequestOutput]:
        """A prefill finished: start its transfer (from its finish: arrival + e2e), or return it when it is the
        request's end."""
        params, arrival, _ = self._originals[output.request_id]
        completion = output.outputs[0] if output.outputs else None
        if output.error is not None or completion is None or completion.finish_reason != "length" or params.max_tokens == 1:
            del self._originals[output.request_id]
            self.metrics.front.observe_finished(output)
            return [output]
        seconds = transfer_s(len(output.prompt_token_ids), self.kv_bytes_per_token, self.bandwidth_gbps, self.latency_s)
        self.transfer_s_total += seconds
        self.num_transfers += 1
        self._seq += 1
        done_s = arrival + (output.metrics.e2e_s if output.metrics and output.metrics.e2e_s is not None else 0.0)
        heapq.heappush(self._transfers, (done_s + seconds, self._seq, output.request_id, list(output.prompt_token_ids)))
        return []

    def _deliver(self, when: float) -> None:
        """The earliest transfer landed at ``when``: its request joins the decode pool."""
        _, _, request_id, prompt_ids = heapq.heappop(self._transfers)
        params, arrival, extra = self._originals.pop(request_id)
        for replica in self.decode.replicas:  # an idle decode replica waits for the K/V, not just the arrival
            if not replica.has_unfinished_requests():
                replica.clock.sleep_until(when)
        decode_params = dataclasses.replace(params, kv_transfer_params={**(params.kv_transfer_params or {}),
                                                                        "do_remote_prefill": True})
        self.decode.add_request(request_id, prompt_ids, decode_params, arrival_time=arrival, **extra)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort wherever the requests are (a transfer in flight is dropped)."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        self._transfers = [t for t in self._transfers if t[2] not in ids]
        heapq.heapify(self._transfers)
        for rid in ids:
            self._originals.pop(rid, None)
        return self.prefill.abort_request(list(ids)) + self.decode.abort_request(list(ids))

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt``."""
        return self.decode.tokenize(prompt)

    def maybe_compile(self, planned_budgets: Sequence[int] | None, repeats: int = 1) -> Any:
        """Nothing compiles in a simulation; the decode pool's decision."""
        return self.decode.maybe_compile(planned_budgets, repeats)

    def check_health(self) -> None:
        """Both pools' health."""
        self.prefill.check_health()
        self.decode.check_health()

    def replica_views(self) -> list[Any]:
        """Prefill replicas, then decode replicas."""
        return [*self.prefill.replica_views(), *self.decode.replica_views()]

    def shutdown(self) -> None:
        """Shut both pools down."""
        self.prefill.shutdown()
        self.decode.shutdown()


def build_disaggregated_sim_engine(config: EngineConfig, metrics: MetricsCollector | None = None) -> DisaggregatedSimEngine:
    """The P/D front of ``config`` (``executor=sim``, ``disagg_prefill_replicas=P > 0``): ``P`` prefill and
    ``data_parallel_size - P`` decode replicas (a pool of one is a ``DataParallelEngine`` of one).

    Raises:
        ValueError: not ``executor=sim``, no prefill replicas, or bad ``kv_transfer.params`` (naming the fix).
    """
    if config.executor != "sim" or config.disagg_prefill_replicas < 1:
        raise ValueError("the simulated P/D front needs executor=sim and disagg.prefill_replicas >= 1 "
                         f"(got executor={config.executor}, disagg.prefill_replicas={config.disagg_prefill_replicas})")
    link_params(config)
    p = config.disagg_prefill_replicas
    prefill = _pool(dataclasses.replace(config, data_parallel_size=p, disagg_prefill_replicas=0), None)
    try:  # a KV connector (offload) serves the prefill pool; every decode replica gets its prompt by transfer
        decode = _pool(dataclasses.replace(config, data_parallel_size=config.data_parallel_size - p,
                                           disagg_prefill_replicas=0, kv_connector="none", kv_connector_params={}),
                       metrics)
    except BaseException:
        prefill.shutdown()
        raise
    rank = prefill.replicas[0].executor.rank
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size  # each rank sends its shard of the K/V
    per_token = rank.kv_cache_bytes_per_block() / config.block_size * ranks
    return DisaggregatedSimEngine(config, prefill, decode, per_token)


def _pool(config: EngineConfig, metrics: MetricsCollector | None) -> DataParallelEngine:
    """A pool as a ``DataParallelEngine`` (one replica: built as a front of one, for one interface)."""
    if config.data_parallel_size > 1:
        engine = build_engine(config, metrics)
        assert isinstance(engine, DataParallelEngine)
        return engine
    return build_data_parallel_engine(config, metrics)
