"""Analytic step times for devices not on this machine (``executor.params.profile=analytic:<device>``).

Every part of a step costs ``max(FLOPs / (peak * efficiency), bytes / (bandwidth * efficiency))`` (the
roofline, Williams et al., CACM 2009), summed over the parts, per tensor-parallel rank (LLM-Viewer,
Yuan et al. 2024, and Vidur's analytic fallbacks do the same):

* linear layers: ``2 * tokens * active weights`` FLOPs, the rank's weights read once (MoE: the experts
  the step's tokens can hit); the LM head likewise on the sampled rows only;
* attention: ``4 * head_dim * query heads`` FLOPs per query-key pair (QK^T and PV) for decode keys and
  causal prefill pairs, the keys' K and V read once per step;
* tensor parallelism: two all-reduces per layer of ``tokens * hidden`` activations (a ring moves
  ``2 (tp - 1) / tp`` of them over the device's link) plus a fixed latency each;
* pipeline parallelism: GPipe's schedule over the busiest stage, plus stage hand-offs; expert parallelism: the
  all-to-all bytes of every MoE layer and the busiest rank's expert load (``framework.sim.parallel_cost``);
* swap preemption: the copied blocks over the host link;
* a fixed host cost per step and per request, and a launch cost per layer (assumed, not measured).

The published peaks and bandwidths are dense (no sparsity). Efficiencies are assumptions stated here,
so every record of such a run is labelled ``analytic``: it ranks configurations on hardware we cannot
measure; it is not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config import EngineConfig
from framework.sim.features import StepFeatures
from framework.sim.memory import (
    DTYPE_BYTES,
    QUANT_WEIGHT_BYTES,
    kv_element_bytes,
    parameter_counts,
    rank_attention_layers,
)
from framework.sim.parallel_cost import ParallelPlan, all_to_all_bytes, stage_layers
from framework.sim.predictor import StepTime, StepTimePredictor
from framework.sim.profile import StepProfile, model_shape_hash

GEMM_EFFICIENCY = 0.7  # fraction of peak FLOP/s a large GEMM reaches
ATTENTION_EFFICIENCY = 0.5  # fraction of peak FLOP/s FlashAttention-style kernels reach
BANDWIDTH_EFFICIENCY = 0.8  # fraction of peak memory bandwidth a streaming kernel reaches
LINK_EFFICIENCY = 0.7  # fraction of the link bandwidth an all-reduce reaches
COLLECTIVE_LATENCY_S = 10e-6  # per all-reduce
LAYER_LAUNCH_S = 10e-6  # kernel launches per layer and step (graphs make it small, not zero)
STEP_HOST_S = 1e-3  # scheduling, input preparation, output processing per step
REQUEST_HOST_S = 5e-6  # per scheduled request
HOST_LINK_BANDWIDTH = 25e9  # bytes/s device <-> host (PCIe, effective) for swap preemption's block copies


@dataclass(frozen=True)
class DeviceSpec:
    """Published numbers of one accelerator (dense, per device)."""

    name: str
    bf16_flops: float  # FLOP/s, dense BF16/FP16 tensor cores
    fp8_flops: float  # FLOP/s, dense FP8 (INT8 where there is no FP8: A100)
    memory_bandwidth: float  # bytes/s, HBM / GDDR
    memory_bytes: int  # device memory, bytes
    link_bandwidth: float  # bytes/s per direction between devices (NVLink; PCIe for L4)


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16, 1979 FP8, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s (both ways)
    "h100": DeviceSpec("H100 SXM5 80GB", 989e12, 1979e12, 3.35e12, 80 * 10**9, 450e9),
    # H200 SXM: H100's compute, 4.8 TB/s HBM3e, 141 GB
    "h200": DeviceSpec("H200 SXM 141GB", 989e12, 1979e12, 4.8e12, 141 * 10**9, 450e9),
    # A100 SXM4 80GB: 312 TFLOP/s BF16, 624 TOPS INT8 (no FP8), 2.039 TB/s HBM2e, NVLink 600 GB/s (both ways)
    "a100": DeviceSpec("A100 SXM4 80GB", 312e12, 624e12, 2.039e12, 80 * 10**9, 300e9),
    # L4: 121 TFLOP/s BF16, 242.5 FP8 (dense), 300 GB/s GDDR6, 24 GB, PCIe Gen4 x16 (~32 GB/s each way)
    "l4": DeviceSpec("L4 24GB", 121e12, 242.5e12, 300e9, 24 * 10**9, 32e9),
}


def _roof(flops: float, bytes_: float, peak: float, bandwidth: float) -> float:
    return max(flops / peak if peak else 0.0, bytes_ / bandwidth if bandwidth else 0.0)


class RooflineStepModel(StepTimePredictor):
    """Analytic step time of ``hf_config``'s model on ``device`` at ``config``'s dtype, quant method, KV cache
    dtype and tensor-parallel size (see the module docstring for the terms).

    Raises:
        ValueError: an unknown device (names the known ones).
    """

    def __init__(self, device: str, hf_config: Any, config: EngineConfig) -> None:
        if device not in DEVICES:
            raise ValueError(f"unknown analytic device {device!r}; known: {', '.join(DEVICES)}")
        self.device = DEVICES[device]
        self.source = f"analytic:{device}"
        self.tp = config.tensor_parallel_size
        self.block_size = config.block_size
        counts = parameter_counts(hf_config)
        self.act_bytes = DTYPE_BYTES[config.dtype]
        weight_bytes = QUANT_WEIGHT_BYTES.get(config.quant) or self.act_bytes
        low_precision = config.quant in ("w8a8", "fp8")  # activations quantized too: the FP8/INT8 tensor cores
        self.gemm_peak = (self.device.fp8_flops if low_precision else self.device.bf16_flops) * GEMM_EFFICIENCY
        self.attention_peak = self.device.bf16_flops * ATTENTION_EFFICIENCY
        self.bandwidth = self.device.memory_bandwidth * BANDWIDTH_EFFICIENCY
        self.num_layers = hf_config.num_hidden_layers
        self.hidden = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or self.hidden // heads
        self.heads_per_rank = heads / self.tp
        # the cache as a rank holds it (the engine's layer specs): K and V heads per rank, or MLA's one latent head
        # (kv_lora_rank + rope channels, no V) whose attention reads it as K and as V (DeepSeek-V2, Sec. 2.1.2)
        layers = rank_attention_layers(hf_config, self.tp, config.mla_latent_cache)
        element, extra = kv_element_bytes(config)
        latent = layers[0].latent_kv
        self.kv_heads_per_rank = float(layers[0].num_kv_heads)
        cache_head = max(layer.cache_head_size for layer in layers)
        self.kv_bytes_per_token = self.num_layers * (1 if latent else 2) * self.kv_heads_per_rank * (
            cache_head * element + extra)
        if latent:  # QK over kv_lora_rank + rope channels, PV over kv_lora_rank: the mean of the two per pair
            self.head_dim = (cache_head + hf_config.kv_lora_rank) / 2
        self.linear_weights = (counts["attention"] + counts["mlp"]) / self.tp  # parameters per rank
        self.linear_weight_bytes = self.linear_weights * weight_bytes
        self.active_per_token = (counts["attention"] + counts["mlp_active_per_token"]) / self.tp
        self.is_moe = counts["mlp"] != counts["mlp_active_per_token"]
        self.experts_fraction_per_token = counts["mlp_active_per_token"] / counts["mlp"] if self.is_moe else 1.0
        self.mlp_bytes = counts["mlp"] / self.tp * weight_bytes
        self.head_params = hf_config.vocab_size * self.hidden / self.tp
        # pipeline and expert parallelism (framework.sim.parallel_cost)
        self.num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0
        self.top_k = getattr(hf_config, "num_experts_per_tok", 1) if self.num_experts else 1
        self.plan = ParallelPlan.from_config(config, self.num_experts)
        self.attention_params, self.mlp_params = counts["attention"], counts["mlp"]
        self.expert_params = (counts["mlp_active_per_token"] / self.top_k) if self.num_experts else 0.0  # one expert, all layers / L
        self.expert_params /= self.num_layers
        self.weight_bytes_per_param = weight_bytes
        self.pipeline_busy_s = 0.0  # stage-seconds of work over the run's pipelined steps
        self.pipeline_bubble_s = 0.0  # stage-seconds idle (GPipe's fill and drain)

    def predict(self, f: StepFeatures) -> StepTime:
        """The roofline time of a step; ``execute_s`` excludes the host costs. With pipeline stages it is GPipe's
        schedule over microbatches (``framework.sim.parallel_cost``); the step's bubble and busy seconds are added
        to :attr:`pipeline_bubble_s` and :attr:`pipeline_busy_s`."""
        swap = f.num_swap_blocks * self.block_size * self.kv_bytes_per_token / HOST_LINK_BANDWIDTH
        plan = self.plan
        if plan.pipeline_stages == 1:
            linear, head, attention, collectives = self._parts(f)
            execute = linear + head + attention + collectives + self.num_layers * LAYER_LAUNCH_S + swap
            return StepTime(execute + STEP_HOST_S + REQUEST_HOST_S * f.num_reqs, execute)
        k = plan.pipeline_stages
        m = max(1, min(plan.microbatches, f.num_reqs))
        scaled = StepFeatures(**{name: value / m for name, value in f.as_dict().items()})  # one microbatch
        linear, head, attention, collectives = self._parts(scaled)
        layers = linear + attention + collectives + self.num_layers * LAYER_LAUNCH_S
        stage_s = layers * stage_layers(self.num_layers, k) / self.num_layers + head  # the last stage: + LM head
        handoff_bytes = f.num_tokens / m * self.hidden * self.act_bytes
        handoff_s = (k - 1) * (handoff_bytes / (self.device.link_bandwidth * LINK_EFFICIENCY) + COLLECTIVE_LATENCY_S)
        self.pipeline_busy_s += m * stage_s
        self.pipeline_bubble_s += (k - 1) * stage_s
        execute = stage_s * (m + k - 1) + handoff_s + swap
        return StepTime(execute + STEP_HOST_S + REQUEST_HOST_S * f.num_reqs, execute)

    def _parts(self, f: StepFeatures) -> tuple[float, float, float, float]:
        """``(linear, head, attention, collectives)`` seconds of all layers for a step (or one microbatch) ``f``."""
        tokens = f.num_tokens
        if self.plan.expert_parallel:
            linear = self._expert_parallel_linear(tokens)
        else:
            weight_bytes = self.linear_weight_bytes
            if self.is_moe:  # experts no token of this step routes to are not read
                hit = min(1.0, tokens * self.experts_fraction_per_token)
                weight_bytes -= self.mlp_bytes * (1.0 - hit)
            linear = _roof(2 * tokens * self.active_per_token,
                           weight_bytes + 2 * tokens * self.hidden * self.act_bytes, self.gemm_peak, self.bandwidth)
        head = _roof(2 * f.num_sampled * self.head_params, self.head_params * self.act_bytes if f.num_sampled else 0,
                     self.gemm_peak, self.bandwidth)
        pair_flops = 4 * self.head_dim * self.heads_per_rank * self.num_layers
        attention = (_roof(pair_flops * f.decode_context, self.kv_bytes_per_token * f.decode_context,
                           self.attention_peak, self.bandwidth)
                     + _roof(pair_flops * f.prefill_pairs, self.kv_bytes_per_token * f.prefill_context,
                             self.attention_peak, self.bandwidth))
        collectives = 0.0
        if self.tp > 1:
            link = self.device.link_bandwidth * LINK_EFFICIENCY
            payload = 2 * (self.tp - 1) / self.tp * tokens * self.hidden * self.act_bytes
            if self.plan.expert_parallel:  # attention's all-reduce, then the MoE's dispatch and combine
                a2a = all_to_all_bytes(tokens, self.top_k, self.hidden, self.act_bytes, self.tp)
                collectives = self.num_layers * (payload / link + COLLECTIVE_LATENCY_S
                                                 + a2a / link + 2 * COLLECTIVE_LATENCY_S)
            else:
                collectives = 2 * self.num_layers * (payload / link + COLLECTIVE_LATENCY_S)
        return linear, head, attention, collectives

    def _expert_parallel_linear(self, tokens: float) -> float:
        """Attention projections tensor-parallel, plus the busiest expert-parallel rank's experts: its share of
        the ``tokens * top_k`` expert assignments times the imbalance, its ``E / ep`` experts' weights read
        where some token hits them."""
        attention = _roof(2 * tokens * self.attention_params / self.tp,
                          self.attention_params / self.tp * self.weight_bytes_per_param
                          + 2 * tokens * self.hidden * self.act_bytes, self.gemm_peak, self.bandwidth)
        assignments = tokens * self.top_k / self.tp * self.plan.expert_imbalance  # busiest rank
        experts_here = self.num_experts / self.tp
        hit = min(1.0, assignments / experts_here)
        moe = _roof(2 * assignments * self.expert_params * self.num_layers,
                    self.mlp_params / self.tp * self.weight_bytes_per_param * hit
                    + 2 * assignments * self.hidden * self.act_bytes * self.num_layers, self.gemm_peak, self.bandwidth)
        return attention + moe


def analytic_profile(device: str, hf_config: Any, config: EngineConfig) -> StepProfile:
    """A profile file's worth of the analytic model (no samples: the constants above are the model).

    Raises:
        ValueError: an unknown device.
    """
    model = RooflineStepModel(device, hf_config, config)
    key = {"model": model_shape_hash(hf_config), "device": f"analytic:{device}", "dtype": config.dtype,
           "kv_cache_dtype": config.kv_cache_dtype, "quant": config.quant,
           "tensor_parallel_size": config.tensor_parallel_size}
    spec = model.device
    return StepProfile(source="analytic", key=key, meta={
        "model": getattr(hf_config, "_name_or_path", "") or hf_config.model_type, "device_name": spec.name,
        "bf16_flops": spec.bf16_flops, "fp8_flops": spec.fp8_flops, "memory_bandwidth": spec.memory_bandwidth,
        "memory_bytes": spec.memory_bytes, "link_bandwidth": spec.link_bandwidth,
        "gemm_efficiency": GEMM_EFFICIENCY, "attention_efficiency": ATTENTION_EFFICIENCY,
        "bandwidth_efficiency": BANDWIDTH_EFFICIENCY, "step_host_s": STEP_HOST_S})
