"""``quant=awq``: loads AWQ checkpoints (AutoAWQ, GEMM version), detected from ``config.json``.

Per quantized layer (``<layer>.qweight`` in the file; AutoAWQ ``WQLinear_GEMM``):

- ``qweight`` ``(in, out / 8)`` int32: 4-bit codes packed along the output dimension in AutoAWQ's interleaved
  order (word slot ``i`` holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its 8, ``plugins/quant/_packing.py``);
- ``qzeros`` ``(groups, out / 8)`` int32: zero points, packed the same way (no offset);
- ``scales`` ``(groups, out)`` float16; ``bias`` ``(out,)`` when the layer has one.

``W[o, i] = (q[i, o] - z[i // group_size, o]) * s[i // group_size, o]``. Only ``version: gemm`` with
``zero_point: true`` and 4 bits (what AutoAWQ writes by default); GEMV/Marlin packings are refused.
Reference: Lin et al., AWQ (MLSys'24); AutoAWQ ``awq/modules/linear/gemm.py`` ``from_linear``.
Params: ``kernel`` (``auto`` | ``reference``, see ``plugins/quant/_checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.model_executor.quantized_checkpoint import CheckpointTensors
from plugins.quant._checkpoint import CheckpointQuantMethod, expect, group_size_problems, num_groups
from plugins.quant._checkpoint_linears import IntWeights
from plugins.quant._packing import awq_unpack


class AWQ(CheckpointQuantMethod):
    """AWQ GEMM checkpoints: 4-bit, group-wise, zero points."""

    name = "awq"
    checkpoint_format = "awq"

    @classmethod
    def config_problems(cls, qc: dict[str, Any]) -> list[str]:
        """``bits`` 4, ``version`` gemm, ``zero_point`` true, ``group_size`` -1 or positive."""
        problems = []
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            problems.append(f"awq: quantization_config.bits={bits!r}; AWQ GEMM checkpoints are 4-bit")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            problems.append(f"awq: quantization_config.version={version!r}; only the GEMM packing loads")
        if not qc.get("zero_point", True):
            problems.append("awq: quantization_config.zero_point=false is not loaded; only zero-point AWQ")
        problems += group_size_problems("awq", qc.get("group_size", qc.get("q_group_size", 128)))
        return problems

    @classmethod
    def tp_group_sizes(cls, qc: dict[str, Any]) -> list[int]:
        """``group_size`` (AutoAWQ's ``q_group_size``; default 128)."""
        return [int(qc.get("group_size", qc.get("q_group_size", 128)))]

    def unpack(self, tensors: CheckpointTensors, qc: dict[str, Any], name: str, linear: torch.nn.Linear,
               ) -> IntWeights | None:
        """Layer ``name``'s ``qweight``/``qzeros``/``scales``/``bias`` as :class:`IntWeights`.

        Raises:
            ValueError: a tensor missing or of the wrong dtype/shape for the layer and ``group_size`` (names it).
        """
        if f"{name}.qweight" not in tensors:
            return None
        out_f, in_f = linear.out_features, linear.in_features
        if out_f % 8:
            raise ValueError(f"{name}: out_features={out_f} is not a multiple of 8, which AWQ packing needs "
                             f"(checkpoint tensor {name}.qweight cannot hold it)")
        groups = num_groups(name, in_f, int(qc.get("group_size", qc.get("q_group_size", 128))))
        qweight = expect(tensors, f"{name}.qweight", torch.int32, (in_f, out_f // 8))
        qzeros = expect(tensors, f"{name}.qzeros", torch.int32, (groups, out_f // 8))
        scales = expect(tensors, f"{name}.scales", (torch.float16, torch.bfloat16, torch.float32), (groups, out_f))
        bias = (expect(tensors, f"{name}.bias", (torch.float16, torch.bfloat16, torch.float32), (out_f,)).float()
                if f"{name}.bias" in tensors else None)
        return IntWeights(codes=awq_unpack(qweight).t().contiguous(), zeros=awq_unpack(qzeros).t().contiguous(),
                          scales=scales.float().t().contiguous(), g_idx=torch.arange(in_f) * groups // in_f,
                          bits=4, bias=bias)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``awq``."""
    register("awq", AWQ)
