"""``quant=int4_wo``: int4 weight-only, group-wise asymmetric (tinygemm layout), gpt-fast style.

Each group of ``group_size`` input channels of an output row has a scale and a zero point:
``w ~= (q - 8) * scale + zero`` with ``q`` in ``[0, 15]``. CPU runs
:class:`~plugins.quant._int_gemm.Int4Linear`: servelab's fused int4 GEMM for bfloat16 activations on AVX512-BF16
CPUs, else torch's own ``aten._weight_int4pack_mm_for_cpu`` on weights packed by
``aten._convert_weight_to_int4pack_for_cpu``; CUDA runs torchao ``Int4WeightOnlyConfig`` (tinygemm
``tile_packed_to_4d``, bfloat16 only).
Reference: gpt-fast (PyTorch, 2023) int4 weight-only; Frantar et al. GPTQ (ICLR'23) Sec. 2 for group-wise.

Params: ``group_size`` (default 128; must divide every quantized layer's ``in_features``: SmolLM2-135M
(hidden 576) needs 32 or 64; stories260K (intermediate 172) needs ``skip=[gate_proj, up_proj, down_proj]``),
``skip`` (module-name suffixes kept full precision), ``kernel`` (``auto``: the fused kernel where it runs;
``aten``: torch's CPU kernel only, the ablation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from plugins.quant._common import LinearQuantMethod, replace_linears, torchao_quantize
from plugins.quant._int_gemm import KERNELS, Int4Linear

if TYPE_CHECKING:
    from framework.config import EngineConfig

GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm / CPU int4pack kernels accept


class Int4PackedLinear(Int4Linear):
    """A float ``nn.Linear`` quantized group-wise to int4 (round to nearest, asymmetric: ``w ~= q * scale + lo``,
    ``q`` in ``[0, 15]``) on :class:`~plugins.quant._int_gemm.Int4Linear`'s kernels. ``forward``: ``x (..., in)``
    float -> ``(..., out)`` same dtype."""

    def __init__(self, linear: torch.nn.Linear, group_size: int, kernel: str = "auto") -> None:
        w = linear.weight.detach().float()
        out_f, in_f = w.shape
        wg = w.view(out_f, in_f // group_size, group_size)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-6)
        q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).view(out_f, in_f)
        super().__init__(q, scale.squeeze(-1), lo.squeeze(-1), group_size, None, None, linear.weight.dtype, kernel)
        self.bias = linear.bias


class Int4WeightOnly(LinearQuantMethod):
    """Group-wise int4 weights; ``lm_head``/embedding untouched.

    Raises:
        ValueError: ``group_size`` not one of ``GROUP_SIZES`` or not dividing a layer's ``in_features``.
    """

    name = "int4_wo"

    def __init__(self, group_size: int = 128, kernel: str = "auto", **params: Any) -> None:
        super().__init__(**params)
        if group_size not in GROUP_SIZES:
            raise ValueError(f"quant.params.group_size must be one of {GROUP_SIZES}, got {group_size}")
        if kernel not in KERNELS:
            raise ValueError(f"quant.params.kernel must be one of {KERNELS}, got {kernel!r}")
        self.group_size, self.kernel = group_size, kernel

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Group size allowed and dividing the model's hidden/intermediate sizes (from config.json);
        bfloat16 on CUDA."""
        problems = super().validate(config)
        if any("Conv1D" in p for p in problems):  # no linears: the shape checks below do not apply
            return problems
        params = config.plugin_params("quant")
        group = params.get("group_size", 128)
        skip = tuple(params.get("skip", ()))
        if group not in GROUP_SIZES:
            return problems + [f"quant.params.group_size must be one of {GROUP_SIZES}, got {group}"]
        if params.get("kernel", "auto") not in KERNELS:
            problems.append(f"quant.params.kernel must be one of {KERNELS}, got {params.get('kernel')!r}")
        from framework.model_executor.model_loader import load_model_config

        mc = load_model_config(config.model)
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        q_out = mc.num_attention_heads * head_dim
        kv_out = (getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads) * head_dim
        in_features = {"q_proj": mc.hidden_size, "k_proj": mc.hidden_size, "v_proj": mc.hidden_size,
                       "gate_proj": mc.hidden_size, "up_proj": mc.hidden_size, "o_proj": q_out,
                       "down_proj": mc.intermediate_size}
        out_features = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out, "o_proj": mc.hidden_size,
                        "gate_proj": mc.intermediate_size, "up_proj": mc.intermediate_size,
                        "down_proj": mc.hidden_size}
        for layer, k in in_features.items():
            if any(layer.endswith(s) for s in skip):
                continue
            if k % group:
                problems.append(f"int4_wo: group_size={group} does not divide {layer}.in_features={k}; choose a "
                                f"group_size dividing it or keep it full precision with quant.params.skip=[{layer}]")
            if out_features[layer] % 16:
                problems.append(f"int4_wo: the int4 kernel needs out_features % 16 == 0 but {layer} has "
                                f"{out_features[layer]}; keep it full precision with quant.params.skip=[{layer}]")
        if config.device.startswith("cuda") and config.dtype != "bfloat16":
            problems.append(f"int4_wo on CUDA runs the bfloat16 tinygemm kernel; use dtype=bfloat16, got {config.dtype}")
        return problems

    @classmethod
    def validate_tp(cls, config: EngineConfig, tp_size: int) -> list[str]:
        """Under tensor parallelism each rank's shard must still split into groups: ``group_size``
        divides every quantized linear's per-rank ``in_features`` (a row-parallel layer holds
        ``in_features / tp_size``) and per-rank ``out_features`` stays a multiple of 16."""
        problems = super().validate_tp(config, tp_size)
        if tp_size == 1:
            return problems
        from framework.model_executor.model_loader import load_model_config
        from framework.model_executor.tensor_parallel import linear_shapes, tp_problems

        mc = load_model_config(config.model)
        if tp_problems(mc, tp_size):
            return problems  # the executor reports those itself
        params = config.plugin_params("quant")
        group, skip = params.get("group_size", 128), tuple(params.get("skip", ()))
        for name, (in_f, out_f) in linear_shapes(mc, tp_size).items():
            if any(name.endswith(s) for s in skip):
                continue
            if in_f % group:
                problems.append(f"int4_wo with tensor_parallel_size={tp_size}: {name} holds in_features={in_f} per "
                                f"rank, not divisible by group_size={group}; pick a smaller group_size or "
                                f"quant.params.skip=[{name.rpartition('.')[2]}]")
            if out_f % 16:
                problems.append(f"int4_wo with tensor_parallel_size={tp_size}: {name} holds out_features={out_f} per "
                                f"rank, not a multiple of 16; quant.params.skip=[{name.rpartition('.')[2]}]")
        return problems

    def selected(self, name: str, module: torch.nn.Module) -> bool:
        """Selected linears; raises ``ValueError`` if ``group_size`` does not divide one's ``in_features``."""
        if not super().selected(name, module):
            return False
        if module.in_features % self.group_size:
            raise ValueError(f"int4_wo: group_size={self.group_size} does not divide {name}.in_features="
                             f"{module.in_features}; pick another group_size or quant.params.skip=[{name}]")
        return True

    def quantize_linears(self, decoder: torch.nn.Module) -> None:
        """CPU: swap in :class:`Int4PackedLinear`; CUDA: torchao ``Int4WeightOnlyConfig``."""
        param = next(decoder.parameters())
        if param.device.type == "cuda":
            from torchao.quantization import Int4WeightOnlyConfig

            self.backend_note = f"torchao Int4WeightOnlyConfig tinygemm (CUDA), group_size={self.group_size}"
            torchao_quantize(decoder, Int4WeightOnlyConfig(group_size=self.group_size,
                                                           int4_packing_format="tile_packed_to_4d"), self)
            return
        kernels: set[str] = set()

        def swap(linear: torch.nn.Linear) -> Int4PackedLinear:
            module = Int4PackedLinear(linear, self.group_size, self.kernel)
            kernels.add(module.kernel)
            return module

        replace_linears(decoder, self, swap)
        self.backend_note = "; ".join(sorted(kernels)) or f"no linear quantized, group_size={self.group_size}"


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``int4_wo``."""
    register("int4_wo", Int4WeightOnly)
