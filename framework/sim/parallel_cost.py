"""What pipeline and expert parallelism add to a simulated step (``framework.sim.roofline`` applies them).

**Pipeline parallelism** (``parallel.pipeline_parallel_size=k``): the layers are split into ``k`` stages of
``ceil(L / k)`` layers (the last also runs the LM head), and a step's batch into ``m`` microbatches
(``executor.params.pp_microbatches``, default ``k``; never more than the step's requests). GPipe's schedule
(Huang et al., "GPipe", NeurIPS 2019, Sec. 2.2) runs ``m + k - 1`` microbatch slots of the busiest stage, so

    step = t_stage(one microbatch) * (m + k - 1) + (k - 1) * (handoff_bytes / link + latency)
    bubble fraction = (k - 1) / (m + k - 1)

where a hand-off moves one microbatch's hidden states (``tokens / m * hidden * dtype bytes``) to the next
stage. When a stage is compute-bound ``t_stage(one microbatch) = t_stage(batch) / m`` and this is
``max stage time * (m + k - 1) / m``; when it streams its weights (small decode batches) every microbatch reads
them again, and the roofline says so.

**Expert parallelism** (``parallel.enable_expert_parallel=true``, MoE models): the experts are partitioned over
the ``ep = tensor_parallel_size`` ranks whole (rank ``r`` holds experts ``[r E / ep, (r + 1) E / ep)``, vLLM's
linear placement) instead of each being sharded, attention stays tensor-parallel (one all-reduce per layer,
not two), and every MoE layer dispatches and combines its tokens all-to-all (DeepSpeed-MoE, Rajbhandari et
al., ICML 2022, Sec. 5; vLLM's ``--enable-expert-parallel``): each token goes to the ranks of its
``min(top_k, ep)`` experts, ``(ep - 1) / ep`` of them remote, so the bytes over all links are
``2 * tokens * min(top_k, ep) * hidden * dtype bytes * (ep - 1) / ep`` per MoE layer, a rank's link carrying
``1 / ep`` of them. The busiest rank sets the MoE time: it gets ``imbalance`` times the mean expert load,
from ``executor.params.expert_skew`` (busiest rank / mean, >= 1) or ``executor.params.expert_loads`` (measured
tokens per expert, e.g. a router's histogram: the busiest rank's sum over the mean rank's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def pipeline_bubble_fraction(num_microbatches: int, num_stages: int) -> float:
    """GPipe's idle share of a pipelined step: ``(k - 1) / (m + k - 1)`` (Huang et al. 2019, Sec. 2.2).

    Raises:
        ValueError: ``num_microbatches`` or ``num_stages`` below 1.
    """
    if num_microbatches < 1 or num_stages < 1:
        raise ValueError(f"a pipeline needs >= 1 microbatch and stage, got m={num_microbatches}, k={num_stages}")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def stage_layers(num_layers: int, num_stages: int) -> int:
    """Layers of the busiest stage: ``ceil(num_layers / num_stages)``."""
    return math.ceil(num_layers / num_stages)


def expert_imbalance(num_experts: int, ep_size: int, skew: float = 1.0, loads: Sequence[float] | None = None) -> float:
    """The busiest expert-parallel rank's load over the mean rank's (1.0: balanced).

    Args:
        num_experts: experts per MoE layer (``E``), split ``E / ep`` per rank in order.
        skew: the ratio itself (``executor.params.expert_skew``), used when ``loads`` is ``None``.
        loads: measured tokens per expert (length ``E``; ``executor.params.expert_loads``).

    Raises:
        ValueError: ``E`` not divisible by ``ep``, ``skew < 1``, or ``loads`` of the wrong length, negative or all 0.
    """
    if num_experts % ep_size:
        raise ValueError(f"expert parallelism over {ep_size} ranks needs the {num_experts} experts to divide evenly; "
                         "choose parallel.tensor_parallel_size dividing the expert count")
    if loads is None:
        if skew < 1.0:
            raise ValueError(f"executor.params.expert_skew is the busiest rank's load over the mean (>= 1), got {skew}")
        return float(skew)
    if len(loads) != num_experts or min(loads) < 0 or sum(loads) <= 0:
        raise ValueError(f"executor.params.expert_loads needs {num_experts} non-negative tokens-per-expert counts, "
                         f"not all 0; got {len(loads)} values")
    per = num_experts // ep_size
    ranks = [sum(loads[r * per:(r + 1) * per]) for r in range(ep_size)]
    return max(ranks) / (sum(ranks) / ep_size)


def all_to_all_bytes(tokens: float, top_k: int, hidden: int, act_bytes: int, ep_size: int) -> float:
    """Bytes one rank's link carries for one MoE layer's dispatch and combine (see the module docstring)."""
    if ep_size <= 1:
        return 0.0
    return 2 * tokens * min(top_k, ep_size) * hidden * act_bytes * (ep_size - 1) / ep_size / ep_size


@dataclass(frozen=True)
class ParallelPlan:
    """The PP and EP settings a roofline prices, read from the engine config and ``executor.params``."""

    pipeline_stages: int  # k: parallel.pipeline_parallel_size
    microbatches: int  # m: executor.params.pp_microbatches (0 -> k)
    expert_parallel: bool  # parallel.enable_expert_parallel
    expert_imbalance: float  # busiest EP rank's load / mean (1.0 without EP)

    @classmethod
    def from_config(cls, config: Any, num_experts: int) -> ParallelPlan:
        """The plan of ``config`` (an ``EngineConfig``) for a model with ``num_experts`` experts (0: dense).

        Raises:
            ValueError: expert parallelism on a dense model, bad ``pp_microbatches``, skew or loads.
        """
        params = config.executor_params
        k = int(getattr(config, "pipeline_parallel_size", 1))
        m = int(params.get("pp_microbatches", 0) or k)
        if m < 1:
            raise ValueError(f"executor.params.pp_microbatches must be >= 1 (0: the stage count), got {m}")
        ep = bool(getattr(config, "enable_expert_parallel", False))
        if ep and not num_experts:
            raise ValueError("parallel.enable_expert_parallel=true needs a MoE model (num_local_experts in "
                             "config.json); set it false for a dense model")
        imbalance = 1.0
        if ep:
            loads = params.get("expert_loads")
            imbalance = expert_imbalance(num_experts, config.tensor_parallel_size,
                                         float(params.get("expert_skew", 1.0)), loads)
        return cls(k, m, ep, imbalance)
