"""``quant=gptq``: loads GPTQ checkpoints (AutoGPTQ / gptqmodel / optimum), detected from ``config.json``.

Per quantized layer (``<layer>.qweight`` in the file; AutoGPTQ ``QuantLinear`` / gptqmodel ``TorchQuantLinear``):

- ``qweight`` ``(in * bits / 32, out)`` int32: codes packed along the input dimension (low bits first);
- ``qzeros`` ``(groups, out * bits / 32)`` int32: zero points packed along the output dimension; in the v1
  format (``checkpoint_format: gptq``, what AutoGPTQ and gptqmodel save) each is stored minus 1, so the loader
  adds 1 back (``gptq_v2`` stores them as they are). A v1 zero point of 0 cannot be stored (AutoGPTQ's ``pack``
  writes -1 as 32 set bits over its neighbours); the loader reads it modulo ``2 ** bits`` and writers keep
  zero points >= 1;
- ``scales`` ``(groups, out)`` float16; ``g_idx`` ``(in,)`` int32, the group of each input column (act-order,
  ``desc_act: true``, permutes them; absent means ``i // group_size``); ``bias`` ``(out,)`` when the layer has one.

``W[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]``; ``groups = in / group_size`` (1 for ``group_size: -1``).
Bits 4 and 8 (3-bit GPTQ packs across words and is refused). Reference: Frantar et al., GPTQ (ICLR'23);
AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` ``pack``.
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
from plugins.quant._packing import unpack_int32

FORMATS = ("gptq", "gptq_v2")  # checkpoint_format: v1 stores zero points minus 1


class GPTQ(CheckpointQuantMethod):
    """GPTQ checkpoints: 4/8-bit, any ``group_size`` (-1 too), ``desc_act`` with ``g_idx``, ``sym`` true/false."""

    name = "gptq"
    checkpoint_format = "gptq"

    @classmethod
    def config_problems(cls, qc: dict[str, Any]) -> list[str]:
        """``bits`` 4 or 8, ``group_size`` -1 or positive, ``checkpoint_format`` gptq or gptq_v2."""
        problems = []
        if qc.get("bits") not in (4, 8):
            problems.append(f"gptq: quantization_config.bits={qc.get('bits')!r}; only 4 and 8 bits load")
        problems += group_size_problems("gptq", qc.get("group_size", -1))
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in FORMATS:
            problems.append(f"gptq: quantization_config.checkpoint_format={fmt!r} (e.g. marlin) is not loaded; "
                            f"expected one of {FORMATS}")
        return problems

    @classmethod
    def tp_group_sizes(cls, qc: dict[str, Any]) -> list[int]:
        """``group_size``; none with ``desc_act`` (act-order keeps scales whole on every rank, as vLLM's GPTQ)."""
        return [] if qc.get("desc_act") else [int(qc.get("group_size", -1))]

    def unpack(self, tensors: CheckpointTensors, qc: dict[str, Any], name: str, linear: torch.nn.Linear,
               ) -> IntWeights | None:
        """Layer ``name``'s ``qweight``/``qzeros``/``scales``/``g_idx``/``bias`` as :class:`IntWeights`.

        Raises:
            ValueError: a tensor missing or of the wrong dtype/shape for ``bits``/``group_size`` (names it).
        """
        if f"{name}.qweight" not in tensors:
            return None
        bits, out_f, in_f = int(qc["bits"]), linear.out_features, linear.in_features
        per_word = 32 // bits
        for what, size in (("in_features", in_f), ("out_features", out_f)):
            if size % per_word:
                raise ValueError(f"{name}: {what}={size} is not a multiple of {per_word}, which {bits}-bit GPTQ "
                                 f"packing needs (checkpoint tensor {name}.qweight cannot hold it)")
        groups = num_groups(name, in_f, int(qc.get("group_size", -1)))
        qweight = expect(tensors, f"{name}.qweight", torch.int32, (in_f // per_word, out_f))
        qzeros = expect(tensors, f"{name}.qzeros", torch.int32, (groups, out_f // per_word))
        scales = expect(tensors, f"{name}.scales", (torch.float16, torch.bfloat16, torch.float32), (groups, out_f))
        if f"{name}.g_idx" in tensors:
            g_idx = expect(tensors, f"{name}.g_idx", (torch.int32, torch.int64), (in_f,)).long()
            if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise ValueError(f"checkpoint tensor {name}.g_idx holds groups outside [0, {groups})")
        else:
            g_idx = torch.arange(in_f) * groups // in_f
        zeros = unpack_int32(qzeros, bits, dim=1)  # (groups, out)
        if qc.get("checkpoint_format", "gptq") == "gptq":
            zeros = (zeros + 1) & (2**bits - 1)  # the v1 offset (see the module docstring for the mask)
        bias = (expect(tensors, f"{name}.bias", (torch.float16, torch.bfloat16, torch.float32), (out_f,)).float()
                if f"{name}.bias" in tensors else None)
        return IntWeights(codes=unpack_int32(qweight, bits, dim=0).t().contiguous(), zeros=zeros.t().contiguous(),
                          scales=scales.float().t().contiguous(), g_idx=g_idx, bits=bits, bias=bias)


@hookimpl
def register_quant_methods(register: Register) -> None:
    """Register ``gptq``."""
    register("gptq", GPTQ)
