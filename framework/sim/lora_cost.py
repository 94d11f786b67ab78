"""What multi-LoRA adds to a simulated step (``executor=sim`` with ``lora.enable=true``): adapter loads into device
slots and the batched LoRA computation, for S-LoRA-style studies of many adapters without their weights.

Per step, over the step's distinct adapters (``r``: an adapter's rank; ``io``: the sum of ``in + out`` features
of the modules it targets, over all layers, per tensor-parallel rank):

* **loads**: an adapter not in one of the ``max_loras`` simulated slots is copied into the least recently used slot
  whose adapter is not in the step (the slot policy of ``LoRAModelManager``): ``r * io`` weights of the model dtype
  over the host link (S-LoRA, Sheng et al. 2023, Sec. 4: adapters stay in host memory, loaded on demand);
* **compute**: the shrink ``x A^T`` and the expand ``(x A^T) B^T`` of every token with an adapter, ``2 r io``
  FLOPs per token (Punica's BGMV, Chen et al. 2023), against reading each distinct adapter's A and B once
  (``r * io`` weights): the roofline ``max(FLOPs / peak, bytes / bandwidth)``, so at the same tokens more distinct
  adapters cost more (the weight reads dominate decode batches, Punica Sec. 5).

The adapter's rank and targets come from its ``adapter_config.json`` alone (no weights read); the device numbers
are a ``framework.sim.roofline`` device's peak and bandwidth at its stated efficiencies, and the host link is
``HOST_LINK_BANDWIDTH``. These are assumptions, as every analytic term is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.core.lora_request import LoRARequest
from framework.model_executor.lora_adapter import TARGET_MODULES, module_shapes, read_adapter_config
from framework.sim.roofline import BANDWIDTH_EFFICIENCY, DEVICES, GEMM_EFFICIENCY, HOST_LINK_BANDWIDTH


@dataclass(frozen=True)
class AdapterSize:
    """One adapter's dimensions as the cost model needs them."""

    rank: int  # LoRA rank r
    io_features: int  # sum over targeted modules and layers of (in + out) features, on one tensor-parallel rank

    @property
    def num_weights(self) -> int:
        """Elements of A and B together: ``rank * io_features``."""
        return self.rank * self.io_features


def adapter_size(lora_request: LoRARequest, hf_config: Any, max_lora_rank: int, tp_size: int = 1) -> AdapterSize:
    """The adapter's rank and targeted widths, from its ``adapter_config.json`` (``target_modules``: a list of
    names; a regex string or ``all-linear`` counts every targetable module) and the model's ``config.json``.

    Raises:
        ValueError: as ``read_adapter_config`` (a missing or bad config, a rank above ``max_lora_rank``).
    """
    rank, _ = read_adapter_config(lora_request, max_lora_rank)
    targets = json.loads((Path(lora_request.lora_path) / "adapter_config.json").read_text()).get("target_modules")
    chosen = set(targets) & set(TARGET_MODULES) if isinstance(targets, list) else set(TARGET_MODULES)
    io = sum(i + o for name, (i, o) in module_shapes(hf_config).items() if name.rpartition(".")[2] in chosen)
    return AdapterSize(rank, -(-io // tp_size))  # one rank holds about 1/tp of each sharded module


class LoRAStepCost:
    """The LoRA seconds of each simulated step (see the module docstring), with its own slot bookkeeping.

    Args:
        hf_config: the model's ``config.json``.
        dtype_bytes: bytes per adapter weight (the model dtype's).
        max_loras: device slots; max_lora_rank: the engine's limit (checked per adapter).
        device: a ``framework.sim.roofline.DEVICES`` name whose peak FLOP/s and bandwidth the LoRA terms use.
        tp_size: tensor-parallel ranks (each holds ~1/tp of every adapter and does ~1/tp of its FLOPs).

    Raises:
        ValueError: an unknown device (names the known ones).
    """

    def __init__(self, hf_config: Any, dtype_bytes: int, max_loras: int, max_lora_rank: int, device: str,
                 tp_size: int = 1) -> None:
        if device not in DEVICES:
            raise ValueError(f"executor.params.lora_device={device!r} is not a known device; use one of "
                             f"{', '.join(DEVICES)}")
        spec = DEVICES[device]
        self.flops_per_s = spec.bf16_flops * GEMM_EFFICIENCY
        self.bytes_per_s = spec.memory_bandwidth * BANDWIDTH_EFFICIENCY
        self.hf_config, self.dtype_bytes, self.tp_size = hf_config, dtype_bytes, tp_size
        self.max_lora_rank = max_lora_rank
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id per simulated slot
        self._slot_used = [0] * max_loras  # step of each slot's latest use (LRU)
        self._step = 0
        self._sizes: dict[int, AdapterSize] = {}
        self.num_loads = 0  # adapters copied into a slot so far
        self.load_bytes = 0  # their bytes

    def step_s(self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> float:
        """Seconds LoRA adds to one step: loads plus the batched shrink/expand.

        Args:
            lora_requests: per scheduled request, its adapter (``None``: the base model).
            num_tokens: per scheduled request, its tokens in this step.
        """
        self._step += 1
        tokens: dict[int, int] = {}
        by_id: dict[int, LoRARequest] = {}
        for request, n in zip(lora_requests, num_tokens):
            if request is not None:
                tokens[request.lora_int_id] = tokens.get(request.lora_int_id, 0) + n
                by_id[request.lora_int_id] = request
        flops = read_bytes = load_bytes = 0.0
        for lora_id, n in tokens.items():
            size = self._size(by_id[lora_id])
            flops += 2.0 * n * size.num_weights
            read_bytes += size.num_weights * self.dtype_bytes
            if self._place(lora_id, set(tokens)):
                load_bytes += size.num_weights * self.dtype_bytes
        self.load_bytes += int(load_bytes)
        compute_s = max(flops / self.flops_per_s, read_bytes / self.bytes_per_s) if tokens else 0.0
        return compute_s + load_bytes / HOST_LINK_BANDWIDTH

    def _size(self, request: LoRARequest) -> AdapterSize:
        size = self._sizes.get(request.lora_int_id)
        if size is None:
            size = self._sizes[request.lora_int_id] = adapter_size(request, self.hf_config, self.max_lora_rank,
                                                                   self.tp_size)
        return size

    def _place(self, lora_id: int, in_step: set[int]) -> bool:
        """Mark ``lora_id``'s slot used; ``True`` when it had to be loaded into one (the manager's LRU rule)."""
        loaded = lora_id not in self.slots
        if loaded:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in in_step]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_used[s]))
            self.slots[slot] = lora_id
            self.num_loads += 1
        self._slot_used[self.slots.index(lora_id)] = self._step
        return loaded
