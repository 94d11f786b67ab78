"""``lora_backend=bgmv`` (the default): every token's LoRA term in one batched product, whatever the step's mix.

Punica's BGMV contract (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024, section 4): one shrink and
one expand for all tokens, each token reading its own adapter. On a GPU that is a fused gather kernel. On the CPU,
``params.kernel=auto`` (default) runs servelab's own (``csrc/bgmv.cpp``): OpenMP over tokens, each token's shrink
and expand read its adapter's A and B in place (B transposed once per slot load), ``R * (in + out)``
multiply-adds per token whatever the number of distinct adapters, float32 accumulation; float32 and bfloat16,
built on first use (:mod:`framework.model_executor.native`). Elsewhere (another device or dtype, no compiler,
``kernel=torch``) plain torch, where gathering ``A[slot[t]]`` and ``B[slot[t]]`` per token materializes
``num_tokens * r * (in + out)`` weights, which on a CPU costs far more than the matmuls. So two torch forms, chosen
per call in :meth:`BGMVBackend.add_lora`:

* ``stacked`` (the step's ``U`` adapters times the rank at most ``params.stacked_max_width``, default 256): the
  step's slots stacked into one ``(U * r, in)`` A and one ``(out, U * r)`` B, read once: shrink ``x A^T`` for all
  slots, zero every column block but the token's own (times its scale), expand. ``2 U r (in + out)`` FLOPs per token
  in two GEMMs (the S-LoRA/vLLM observation that a few adapters cost about one wider LoRA);
* ``gather`` (wider steps): the per-token gather above, in one ``bmm`` each; its cost does not grow with ``U``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces.lora_backend import LoRABackend, LoRABatch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "bgmv.cpp"
CXX_FLAGS = ("-O3", "-std=c++17", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
KERNELS = ("auto", "torch")  # auto: servelab's C++ kernel where it runs (CPU, float32/bfloat16); torch: plain torch
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _library() -> tuple[ctypes.PyDLL | None, str]:
    """The built kernel (:func:`framework.model_executor.native.build_kernel`), or ``(None, why not)``: it is
    compiled for AVX2 with FMA, which this CPU must have."""
    from framework.model_executor.native import build_kernel
    from framework.platform import cpu_isa

    isa = cpu_isa()
    if missing := [f for f in ("avx2", "fma") if f not in isa.flags]:
        return None, f"this CPU lacks {', '.join(missing)}"
    lib, why = build_kernel(SOURCE, CXX_FLAGS)
    if lib is not None:
        p, long_, int_ = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
        lib.servelab_bgmv.argtypes = [p, long_, p, p, p, p, p, long_, int_, int_, int_, int_, p, p, int_, int_, int_]
        lib.servelab_bgmv.restype = int_
    return lib, why


class BGMVBackend(LoRABackend):
    """One batched shrink and expand per linear for all tokens (module docstring: ``stacked`` or ``gather``).

    Params: ``kernel`` (``auto``, default: the C++ kernel where it runs; ``torch``: the torch forms only, the
    ablation); ``stacked_max_width`` (int, default 256): the torch forms' widest ``U * max_lora_rank`` run
    ``stacked``; 0: always ``gather``. Memory: the kernel, a transposed copy of each linear's B; ``stacked``
    ``num_tokens * U * r`` shrunk values; ``gather`` ``num_tokens * r * (in + out)`` gathered weights.
    """

    name = "bgmv"

    def __init__(self, stacked_max_width: int = 256, kernel: str = "auto", **params: Any) -> None:
        """Raises ``ValueError`` for a ``stacked_max_width`` that is not an int >= 0 or an unknown ``kernel``."""
        super().__init__(stacked_max_width=stacked_max_width, kernel=kernel, **params)
        if not isinstance(stacked_max_width, int) or stacked_max_width < 0:
            raise ValueError(f"lora_backend.params.stacked_max_width must be an int >= 0 (0: always gather), got "
                             f"{stacked_max_width!r}")
        if kernel not in KERNELS:
            raise ValueError(f"lora_backend.params.kernel must be one of {KERNELS}, got {kernel!r}")
        self.stacked_max_width, self.kernel = stacked_max_width, kernel
        # per linear, by id(lora_a): (a weak reference to it, versions and slot set, stacked A, stacked B)
        self._stacks: dict[int, tuple[weakref.ref, Any, torch.Tensor, torch.Tensor]] = {}
        # per linear, by id(lora_b): (a weak reference to it, its version, B transposed (S, R, out) contiguous)
        self._transposed: dict[int, tuple[weakref.ref, Any, torch.Tensor]] = {}
        self._logged: set[str] = set()

    def prepare(self, token_slots: torch.Tensor) -> LoRABatch:
        """Each token's slot, and ``extra``: the step's distinct slots ``used`` ``(U,) int64`` with each token's
        one-hot place among them ``(num_tokens, U) float32`` (zero for the base model's tokens)."""
        used = torch.unique(token_slots[token_slots >= 0])
        onehot = (token_slots[:, None] == used[None, :]).to(torch.float32)  # (T, U)
        # the step's per-token weights, built by the first linear and reused by the others (same scales, rank, dtype)
        weights: dict[tuple[Any, ...], torch.Tensor] = {}
        return LoRABatch(token_slots=token_slots, any_lora=bool(used.numel()),
                         extra=(used, onehot, tuple(used.tolist()), weights))

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scales: torch.Tensor, batch: LoRABatch, part_sizes: tuple[int, ...] | None = None) -> None:
        """``y[t] += scales[s] * B[s] (A[s] x[t])`` for every token at once (``s = -1``: nothing added). A fused
        linear (``part_sizes``) shrinks once for all its parts and expands each part with its own rank block of B
        (its zeros skipped); the stacked/gather choice counts one part's rank, as for an unfused linear."""
        sizes = part_sizes or (lora_b.shape[1],)
        if self._native(y, x, lora_a, lora_b, scales, batch.token_slots, sizes):
            return
        used, onehot, used_key, weights = batch.extra
        rank = lora_a.shape[1] // len(sizes)  # each part's rank block
        starts = (0, *accumulate(sizes[:-1]))
        if used.numel() * rank <= self.stacked_max_width:
            a, parts_b = self._stacked(lora_a, lora_b, used, used_key, sizes)
            key = (id(scales), rank, x.dtype)
            weight = weights.get(key)
            if weight is None:  # (T, U * r): the token's own column block, times its adapter's scale
                weight = weights[key] = (onehot * scales[used]).to(x.dtype).repeat_interleave(rank, dim=1)
            shrunk = (x @ a.T).view(x.shape[0], used.numel(), len(sizes), rank)  # columns: slot, part, rank
            for p, b in enumerate(parts_b):
                term = (shrunk[:, :, p].reshape(x.shape[0], -1) * weight) @ b.T
                y[:, starts[p]:starts[p] + sizes[p]].add_(term)
            return
        slots = batch.token_slots
        index = slots.clamp(min=0)
        shrunk = torch.bmm(lora_a[index], x.unsqueeze(-1))  # (T, P * r, 1)
        scale = torch.where(slots >= 0, scales[index], torch.zeros((), dtype=scales.dtype, device=scales.device))
        scale = scale.unsqueeze(-1).to(shrunk.dtype)  # (T, 1), once for every part
        for p, (start, size) in enumerate(zip(starts, sizes)):
            b = lora_b[index, start:start + size, p * rank:(p + 1) * rank]  # (T, out_p, r)
            expanded = torch.bmm(b, shrunk[:, p * rank:(p + 1) * rank]).squeeze(-1)  # (T, out_p)
            y[:, start:start + size].add_((expanded * scale).to(y.dtype))

    def _native(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scales: torch.Tensor, slots: torch.Tensor, sizes: tuple[int, ...]) -> bool:
        """The C++ kernel's ``add_lora``; False (nothing done, the reason logged once) where it does not run."""
        why = None
        if self.kernel != "auto":
            why = "lora_backend.params.kernel=torch"
        elif x.device.type != "cpu" or x.dtype not in _DTYPES:
            why = f"{x.device.type} {x.dtype} (the kernel takes CPU float32/bfloat16)"
        elif not (x.dtype == y.dtype == lora_a.dtype == lora_b.dtype) or y.stride(-1) != 1:
            why = "mixed dtypes or a strided output"
        else:
            lib, why = _library()
            why = why or None
        if why is not None:
            if why not in self._logged:
                self._logged.add(why)
                logger.info("lora_backend=bgmv: the torch forms (%s)", why)
            return False
        if "kernel" not in self._logged:
            self._logged.add("kernel")
            logger.info("lora_backend=bgmv: servelab_bgmv (C++, OpenMP over tokens, %s)", x.dtype)
        x2, bt = x.contiguous(), self._b_transposed(lora_b)
        a, slots, scales = lora_a.contiguous(), slots.contiguous(), scales.to(torch.float32).contiguous()
        nparts = len(sizes)
        starts = (ctypes.c_int * nparts)(*accumulate((0, *sizes[:-1])))
        rc = lib.servelab_bgmv(x2.data_ptr(), x2.stride(0), a.data_ptr(), bt.data_ptr(), scales.data_ptr(),
                               slots.data_ptr(), y.data_ptr(), y.stride(0), x2.shape[0], x2.shape[1],
                               lora_a.shape[1] // nparts, nparts, starts, (ctypes.c_int * nparts)(*sizes),
                               lora_b.shape[1], _DTYPES[x.dtype], torch.get_num_threads())
        if rc:
            raise RuntimeError(f"servelab_bgmv returned {rc} ({'bad arguments' if rc == 1 else 'out of memory'})")
        return True

    def _b_transposed(self, lora_b: torch.Tensor) -> torch.Tensor:
        """``lora_b`` ``(S, out, R)`` as ``(S, R, out)`` contiguous, kept while its version counter stays (a slot
        load's in-place copy bumps it); inference tensors have none: transposed afresh each call."""
        try:
            version = lora_b._version
        except RuntimeError:
            return lora_b.transpose(1, 2).contiguous()
        hit = self._transposed.get(id(lora_b))
        if hit is not None and hit[0]() is lora_b and hit[1] == version:
            return hit[2]
        bt = lora_b.transpose(1, 2).contiguous()
        ident = id(lora_b)
        self._transposed[ident] = (weakref.ref(lora_b, lambda _: self._transposed.pop(ident, None)), version, bt)
        return bt

    def _stacked(self, lora_a: torch.Tensor, lora_b: torch.Tensor, used: torch.Tensor, used_key: tuple[int, ...],
                 sizes: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's slots of one linear stacked: A ``(U * P * r, in)`` (rows: slot, part, rank) and each part's B
        ``(out_p, U * r)`` (its own rank block of each slot), ``P = len(sizes)``.

        Kept per linear while its slots and the step's slot set stay the same (keyed on the buffers' version
        counters, which a slot load's in-place copy bumps): stacking copied every adapter's A and B in every linear
        of every step. Buffers made under ``torch.inference_mode`` have no version counter: stacked afresh."""
        try:
            key = (lora_a._version, lora_b._version, used_key, sizes)
        except RuntimeError:  # inference tensors do not track versions
            key = None
        hit = self._stacks.get(id(lora_a)) if key is not None else None
        if hit is not None and hit[0]() is lora_a and hit[1] == key:
            return hit[2], hit[3]
        if used_key == tuple(range(lora_a.shape[0])):  # every slot, in order: A is a view
            a = lora_a.reshape(-1, lora_a.shape[2])
        else:
            a = lora_a[used].reshape(-1, lora_a.shape[2])
        rank, start, b = lora_a.shape[1] // len(sizes), 0, []
        for p, size in enumerate(sizes):
            block = lora_b[used, start:start + size, p * rank:(p + 1) * rank]  # (U, out_p, r)
            b.append(block.permute(1, 0, 2).reshape(size, -1))
            start += size
        if key is not None:  # the entry leaves with its buffer (tensors hash by identity but compare by value)
            ident = id(lora_a)
            ref = weakref.ref(lora_a, lambda _: self._stacks.pop(ident, None))
            self._stacks[ident] = (ref, key, a, b)
        return a, b


@hookimpl
def register_lora_backends(register: Register) -> None:
    """Register ``bgmv``."""
    register("bgmv", BGMVBackend)
