"""Multi-LoRA on a loaded model: LoRA-wrapped linears with slot-stacked weights, and the slot/LRU manager.

vLLM's design (``vllm/lora/layers``, ``LoRAModelManager``), after Punica and S-LoRA: every targetable linear
(``lora_adapter.TARGET_MODULES``) of a loaded model is wrapped once, at start-up, by a :class:`LoRALinear` that owns
``max_loras`` slots of zero-padded A and B (stacked tensors, so the set of adapters can change without new
shapes). A step's adapters are placed into slots by :class:`LoRAModelManager` before the forward; adapters not in
a slot stay loaded in an LRU cache of ``max_cpu_loras`` on the CPU, and are read from disk on demand. The
per-token computation is the ``lora_backend`` plugin's (``framework/interfaces/lora_backend.py``).

Prepacked linears (:class:`~framework.model_executor.prepack.PrepackedLinear`) are wrapped like an ``nn.Linear``. A
fused q/k/v (``qkv_proj``) or gate/up (``gate_up_proj``) GEMM is wrapped once, with one rank block per part: its A
stacks the parts' A (``parts * max_lora_rank`` rows) and its B is block-diagonal, so one shrink and one expand give
every part its own adapter term (vLLM's ``MergedColumnParallelLinearWithLoRA`` / ``QKVParallelLinearWithLoRA``
idea); the manager addresses each part by its unfused module name (:class:`LoRAPart`). Under tensor parallelism
the worker does not fuse them, and each slot holds this rank's cut of A and B
(``framework/model_executor/lora_tp.py``: B's rows on a column-parallel linear, A's columns on a row-parallel one,
whose LoRA term joins its partial output before the all-reduce).

Under ``engine.compile=true`` the LoRA term is the opaque custom op ``torch.ops.servelab.lora`` (like attention's
``servelab::attention``): the compiled layer graphs see only fixed-shape slot buffers, so changing which adapters
sit in the slots, or how many a step uses, never recompiles (the per-step batch is read from the forward context
inside the op).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from framework.core.lora_request import LoRARequest
from framework.interfaces.lora_backend import LoRABackend, LoRABatch
from framework.model_executor.forward_context import current_lora
from framework.model_executor.lora_adapter import TARGET_MODULES, LoRAAdapter, load_adapter
from framework.model_executor.parallel_layers import RowParallelLinear, Shard
from framework.model_executor.prepack import FusedGatedMLP, PrepackedLinear

#: float linears LoRA wraps as they are (a quantized base is recognized by :func:`_is_quantized_linear`)
PLAIN_LINEARS = (nn.Linear, PrepackedLinear)


@dataclass
class LoRAStep:
    """What every LoRA-wrapped linear reads during one forward (``ForwardContext.lora``)."""

    backend: LoRABackend  # the rank's lora_backend plugin
    batch: LoRABatch  # backend.prepare(token_slots) of this step
    scales: torch.Tensor  # (max_loras,) float32: each slot's adapter scale (0 for an empty slot)


class LoRALinear(nn.Module):
    """An ``nn.Linear`` plus ``max_loras`` LoRA slots: ``y = base(x) + backend.add_lora(...)`` for the tokens whose
    request carries an adapter (the current forward's :class:`LoRAStep`), ``base(x)`` otherwise.

    A quantized base (``quant=int8_wo``/``int4_wo``, a GPTQ checkpoint's layer: any module with integer
    ``in_features``/``out_features`` and float input and output) is wrapped the same way: its output is the base
    term, the LoRA term is added in the compute dtype (vLLM's rule: the base layer may be quantized, A and B are not).

    Args:
        base: the model's linear (kept as is, weights untouched); under tensor parallelism this rank's shard.
        max_loras: slots.
        max_lora_rank: slot width (ranks below it are zero-padded).
        shard: the cut of the full weight ``base`` holds (``dim`` 0: output rows, so :meth:`set_slot` keeps B's
            rows ``[start, stop)``; 1: input columns, so A's columns); ``None``: the whole linear.
        dtype: the slots' dtype when ``base`` has no float ``weight`` (a quantized layer): the model's compute
            dtype; ignored for an ``nn.Linear`` (its weight's dtype).
        parts: a fused linear's parts' output widths, in order (``qkv_proj``: q, k, v); ``None``: one part.
            Slots are then ``len(parts) * max_lora_rank`` wide, part ``p``'s rank block at ``p * max_lora_rank``.

    Raises:
        ValueError: ``base`` has no float ``weight`` and no ``dtype`` was given; ``parts`` do not sum to
            ``out_features``, or are given with a ``shard``.
    """

    def __init__(self, base: nn.Module, max_loras: int, max_lora_rank: int, shard: Shard | None = None,
                 dtype: torch.dtype | None = None, parts: Sequence[int] | None = None) -> None:
        super().__init__()
        self.base = base
        self.shard = shard
        self.part_sizes = tuple(parts) if parts else (base.out_features,)
        if sum(self.part_sizes) != base.out_features or (parts and shard is not None):
            raise ValueError(f"LoRA parts {self.part_sizes} must sum to out_features={base.out_features}, unsharded")
        self.max_lora_rank = max_lora_rank
        weight = getattr(base, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_floating_point():
            kw = {"dtype": weight.dtype, "device": weight.device}
        elif dtype is None:
            raise ValueError(f"{type(base).__name__} has no float weight: pass the model's compute dtype")
        else:
            tensor = next(iter(base.buffers()), None)
            kw = {"dtype": dtype, "device": tensor.device if tensor is not None else torch.device("cpu")}
        # (max_loras, width, in_features) / (max_loras, out_features, width), width = parts * max_lora_rank, model dtype
        width = len(self.part_sizes) * max_lora_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, base.in_features, **kw), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, base.out_features, width, **kw), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The base linear's weight ``(out_features, in_features)``."""
        return self.base.weight

    @property
    def in_features(self) -> int:
        """The base linear's input width."""
        return self.base.in_features

    @property
    def out_features(self) -> int:
        """The base linear's output width."""
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(..., in_features)`` -> ``(..., out_features)``; the step's tokens in flattened order."""
        y = self.base(x)
        if torch.compiler.is_compiling():  # traced once: the step's adapters are data the op reads, not guards
            return lora_op(y, x, self.lora_a, self.lora_b, list(self.part_sizes))
        step: LoRAStep | None = current_lora()
        if step is None or not step.batch.any_lora:
            return y
        flat_y = y.reshape(-1, y.shape[-1])  # a view: add_lora writes into y
        step.backend.add_lora(flat_y, x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b, step.scales, step.batch,
                              **_parts_kwarg(self.part_sizes))
        return y

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, part: int = 0) -> None:
        """Write one adapter's ``a`` ``(r, in)`` and ``b`` ``(out, r)`` of ``part`` (0 unless fused) into ``slot``
        (zeros elsewhere in the part's blocks; ``None``: the adapter does not target this module); full shapes, cut
        here to this rank's :attr:`shard`."""
        r0, width = part * self.max_lora_rank, self.max_lora_rank
        o0 = sum(self.part_sizes[:part])
        rows = slice(o0, o0 + self.part_sizes[part])
        self.lora_a[slot, r0:r0 + width].zero_()
        self.lora_b[slot, rows, r0:r0 + width].zero_()  # the other parts' rows of these columns stay zero
        if a is not None and b is not None:
            if self.shard is not None and self.shard.dim == 0:
                b = b[self.shard.start:self.shard.stop]
            elif self.shard is not None:
                a = a[:, self.shard.start:self.shard.stop]
            rank = a.shape[0]
            self.lora_a[slot, r0:r0 + rank].copy_(a)
            self.lora_b[slot, rows, r0:r0 + rank].copy_(b)


def _parts_kwarg(part_sizes: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """``add_lora``'s ``part_sizes`` for a fused linear; nothing for one part (a backend may predate the argument)."""
    return {"part_sizes": tuple(part_sizes)} if len(part_sizes) > 1 else {}


class LoRAPart:
    """One part of a fused :class:`LoRALinear` (``q_proj`` of a ``qkv_proj``...), as :class:`LoRAModelManager`
    addresses a linear: its shapes, the fused layer's slot buffers and base, and :meth:`set_slot` into its blocks."""

    def __init__(self, fused: LoRALinear, part: int) -> None:
        self.fused, self.part = fused, part
        self.in_features, self.out_features = fused.in_features, fused.part_sizes[part]
        self.lora_a, self.lora_b, self.base = fused.lora_a, fused.lora_b, fused.base

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """:meth:`LoRALinear.set_slot` of this part."""
        self.fused.set_slot(slot, a, b, self.part)


# The step's LoRA batch (per-token slots, any_lora) varies in structure from step to step and lives in the forward
# context, so it is read inside the op rather than passed: the traced graph depends only on the slot buffers' shapes.
@torch.library.custom_op("servelab::lora", mutates_args=())
def lora_op(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
            part_sizes: list[int]) -> torch.Tensor:
    """``y`` plus the current forward's LoRA term (opaque to dynamo; :meth:`LoRALinear.forward` under compile).

    Args:
        y: ``(..., out_features)`` the base linear's output, model dtype.
        x: ``(..., in_features)`` its input.
        lora_a: ``(max_loras, max_lora_rank, in_features)``; lora_b: ``(max_loras, out_features, max_lora_rank)``.
        part_sizes: a fused linear's parts' output widths (one entry unless fused; ``LoRABackend.add_lora``'s).

    Returns:
        A new tensor shaped like ``y``: ``y`` plus ``backend.add_lora``'s term for the tokens with an adapter
        (``y``'s values when the step has none, or outside a forward context).
    """
    out = y.clone(memory_format=torch.contiguous_format)  # may not alias an input; add_lora writes a view
    step: LoRAStep | None = current_lora()
    if step is not None and step.batch.any_lora:
        step.backend.add_lora(out.reshape(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), lora_a, lora_b,
                              step.scales, step.batch, **_parts_kwarg(part_sizes))
    return out


@lora_op.register_fake
def _lora_fake(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               part_sizes: list[int]) -> torch.Tensor:
    """Shape-only version for tracing: like ``y``."""
    return torch.empty_like(y)


def _is_quantized_linear(module: nn.Module) -> bool:
    """A quant method's replacement of an ``nn.Linear`` (int8/int4 packed layers): integer ``in_features`` and
    ``out_features``, no float ``weight``."""
    weight = getattr(module, "weight", None)
    return (isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int)
            and not (isinstance(weight, torch.Tensor) and weight.is_floating_point()))


def _fused_parts(module: nn.Module) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
    """``module``'s fused prepacked GEMMs (``prepack._fuse_projections``): ``(attribute, part names, part widths)``."""
    found = []
    if type(getattr(module, "qkv_proj", None)) is PrepackedLinear and hasattr(module, "qkv_sizes"):
        found.append(("qkv_proj", ("q_proj", "k_proj", "v_proj"), tuple(module.qkv_sizes)))
    if isinstance(module, FusedGatedMLP) and type(module.gate_up_proj) is PrepackedLinear:
        found.append(("gate_up_proj", ("gate_proj", "up_proj"), (module.intermediate_size,) * 2))
    return found


def wrap_lora_linears(model: nn.Module, max_loras: int, max_lora_rank: int,
                      shards: dict[str, Shard] | None = None,
                      dtype: torch.dtype | None = None) -> dict[str, LoRALinear | LoRAPart]:
    """Replace every ``nn.Linear`` (prepacked or not, or a quantized linear) named one of ``TARGET_MODULES`` in
    ``model`` by a :class:`LoRALinear` (in place); a :class:`RowParallelLinear`'s inner shard is wrapped, so its LoRA
    term is all-reduced with the base output.

    Args:
        shards: under tensor parallelism, each module's weight shard (``lora_tp.lora_shards``); ``None``: one rank.
        dtype: the compute dtype of slots over quantized linears (``None``: the model's ``dtype`` attribute).

    Returns:
        The wrapped linears by their module name in ``model`` (``model.layers.0.self_attn.q_proj``...); a fused
        linear's parts by their unfused names (:class:`LoRAPart`).
    """
    wrapped: dict[str, LoRALinear | LoRAPart] = {}
    dtype = dtype or getattr(model, "dtype", None)
    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        for fused_name, part_names, sizes in _fused_parts(module):
            layer = LoRALinear(getattr(module, fused_name), max_loras, max_lora_rank, None, dtype, parts=sizes)
            setattr(module, fused_name, layer)
            wrapped.update({prefix + part: LoRAPart(layer, i) for i, part in enumerate(part_names)})
        for child_name, child in list(module.named_children()):
            full_name = f"{name}.{child_name}" if name else child_name
            shard = (shards or {}).get(full_name)
            if child_name in TARGET_MODULES and (type(child) in PLAIN_LINEARS or (
                    shard is None and not isinstance(child, RowParallelLinear) and _is_quantized_linear(child))):
                layer = LoRALinear(child, max_loras, max_lora_rank, shard, dtype)
                setattr(module, child_name, layer)
                wrapped[full_name] = layer
            elif (child_name in TARGET_MODULES and isinstance(child, RowParallelLinear)
                  and type(child.linear) in PLAIN_LINEARS):
                child.linear = wrapped[full_name] = LoRALinear(child.linear, max_loras, max_lora_rank, shard)
    return wrapped


class LoRAModelManager:
    """One rank's adapters: which adapter sits in each device slot, the CPU LRU cache, loading on demand.

    Args:
        model: the loaded model (one rank); its targets are wrapped here, a fused q/k/v or gate/up as its parts.
        backend: the ``lora_backend`` plugin instance.
        max_loras: device slots; the scheduler never puts more distinct adapters into one step.
        max_lora_rank: the largest rank accepted.
        max_cpu_loras: adapters kept loaded on the CPU (LRU), slots' adapters included.
        shards: under tensor parallelism, each targetable module's weight shard on this rank
            (``lora_tp.lora_shards``); ``None``: one rank.
        full_shapes: with ``shards``, each module's unsharded ``(in_features, out_features)`` (what adapters are
            checked against); ``None``: the wrapped linears' own shapes.

    Raises:
        ValueError: the model has none of ``TARGET_MODULES`` as ``nn.Linear`` or quantized linear (fused linears).
    """

    def __init__(self, model: nn.Module, backend: LoRABackend, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, shards: dict[str, Shard] | None = None,
                 full_shapes: dict[str, tuple[int, int]] | None = None) -> None:
        self.layers = wrap_lora_linears(model, max_loras, max_lora_rank, shards)
        if not self.layers:
            raise ValueError(f"LoRA found none of {TARGET_MODULES} as nn.Linear or quantized linear in the model; "
                             "engine.prepack_linears=off keeps the model's own linears")
        self.shapes = {name: (full_shapes or {}).get(name, (m.in_features, m.out_features))
                       for name, m in self.layers.items()}
        first = next(iter(self.layers.values()))
        self.device, self.dtype = first.lora_a.device, first.lora_a.dtype
        self.backend = backend
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.slots: list[int | None] = [None] * max_loras  # lora_int_id held by each device slot
        self.scales = torch.zeros(max_loras, dtype=torch.float32, device=self.device)
        self._slot_used = [0] * max_loras  # step counter of each slot's latest use (LRU eviction)
        self._step = 0
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU order
        self.num_loads = 0  # adapters read from disk (cache misses)
        self.num_slot_swaps = 0  # adapters copied into a device slot

    def prepare_step(self, lora_requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> LoRAStep | None:
        """Place this step's adapters into slots and build the per-token slot map.

        Called by the model runner before each forward, with the step's requests in their flattened order.

        Args:
            lora_requests: per request, its adapter (``None``: base model).
            num_tokens: per request, its tokens in this step's flattened batch.

        Returns:
            The step's :class:`LoRAStep`, or ``None`` when no request carries an adapter.

        Raises:
            RuntimeError: more distinct adapters than slots (the scheduler's ``max_loras`` rule prevents it).
            ValueError: an adapter that fails to load (:func:`load_adapter`).
        """
        self._step += 1
        ids = {r.lora_int_id: r for r in lora_requests if r is not None}
        if not ids:
            return None
        if len(ids) > len(self.slots):
            raise RuntimeError(f"{len(ids)} adapters in one step but max_loras={len(self.slots)} slots")
        slot_of = {lora_id: self._activate(request, set(ids)) for lora_id, request in ids.items()}
        per_request = [slot_of[r.lora_int_id] if r is not None else -1 for r in lora_requests]
        token_slots = torch.repeat_interleave(torch.tensor(per_request, dtype=torch.int64),
                                              torch.tensor(list(num_tokens), dtype=torch.int64)).to(self.device)
        return LoRAStep(self.backend, self.backend.prepare(token_slots), self.scales)

    def _activate(self, request: LoRARequest, in_step: set[int]) -> int:
        """The slot holding ``request``'s adapter, loading it into the least recently used slot whose adapter is
        not in this step when it is not in one."""
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            slot = self.slots.index(lora_id)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in in_step]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_used[s]))
            adapter = self._get_adapter(request)
            for name, layer in self.layers.items():
                a, b = adapter.weights.get(name, (None, None))
                layer.set_slot(slot, a, b)
            self.scales[slot] = adapter.scale
            self.slots[slot] = lora_id
            self.num_slot_swaps += 1
        self._slot_used[slot] = self._step
        return slot

    def _get_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter from the CPU cache (refreshing its LRU position), else from disk (evicting the LRU one)."""
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.shapes, self.max_lora_rank, self.dtype)
            self.num_loads += 1
            self.cpu_cache[request.lora_int_id] = adapter
            while len(self.cpu_cache) > self.max_cpu_loras:
                self.cpu_cache.popitem(last=False)
        self.cpu_cache.move_to_end(request.lora_int_id)
        return adapter

    def stats(self) -> dict[str, Any]:
        """Slots' adapter ids, CPU-cached ids (LRU first), loads from disk and slot swaps so far."""
        return {"slots": list(self.slots), "cpu_cached": list(self.cpu_cache), "num_loads": self.num_loads,
                "num_slot_swaps": self.num_slot_swaps}
