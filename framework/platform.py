"""What this machine's CPU computes natively, and the dtype ``dtype="auto"`` runs a checkpoint in.

vLLM's CPU platform (``vllm/platforms/cpu.py``) asks the same question: a bf16 or fp16 checkpoint is only
fast on a CPU with instructions for that dtype. Without them (AMD Zen 3 and older Intel: AVX2 only, or
AVX-512 without its BF16/FP16 extensions) oneDNN refuses to prepack 16-bit GEMMs ("bf16 path needs
avx_ne_convert or avx512bw") and ATen converts every element in scalar code: SmolLM2's bf16 folder ran the
README's main job 4.4x slower than the same weights in float32 on a 2-core Zen 3 (issue 65). So on such a
CPU ``dtype="auto"`` loads a 16-bit checkpoint in float32 (bf16 and fp16 widen to float32 exactly).

The ISA is read from ``/proc/cpuinfo``'s flags and then capped by what the kernels are allowed to use:
``ONEDNN_MAX_CPU_ISA`` (oneDNN's cap) and ``ATEN_CPU_CAPABILITY`` (ATen's vector kernels), so that
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine makes the dtype rule behave as
on an AVX2-only CPU, as the kernels do. ``SERVELAB_CPU_FLAGS`` (space- or comma-separated flags) replaces
the flags read from ``/proc/cpuinfo`` (tests fake an ISA with it).
"""

from __future__ import annotations

import functools
import os
import platform as _platform
from dataclasses import dataclass
from pathlib import Path

#: flags of instructions that compute on bfloat16 (dot products / tile multiplies / packed conversion)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")
#: flags of instructions that compute on float16
NATIVE_FP16_FLAGS = ("avx512_fp16", "amx_fp16", "avx_ne_convert")
#: the flags :meth:`CpuIsa.summary` names, in order of capability
SUMMARY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx_ne_convert", "amx_bf16", "amx_fp16")
FLAGS_ENV = "SERVELAB_CPU_FLAGS"

# oneDNN's ONEDNN_MAX_CPU_ISA values (oneDNN docs, "CPU ISA dispatcher control"), lowest first, and the
# flags each level adds. A cap keeps the flags of its level and below.
_ONEDNN_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("SSE41", frozenset()),
    ("AVX", frozenset({"avx"})),
    ("AVX2", frozenset({"avx2", "fma", "f16c"})),
    ("AVX2_VNNI", frozenset({"avx_vnni"})),
    ("AVX2_VNNI_2", frozenset({"avx_ne_convert", "avx_vnni_int8"})),
    ("AVX512_CORE", frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"})),
    ("AVX512_CORE_VNNI", frozenset({"avx512_vnni"})),
    ("AVX512_CORE_BF16", frozenset({"avx512_bf16"})),
    ("AVX512_CORE_FP16", frozenset({"avx512_fp16"})),
    ("AVX512_CORE_AMX", frozenset({"amx_tile", "amx_bf16", "amx_int8"})),
    ("AVX512_CORE_AMX_FP16", frozenset({"amx_fp16"})),
)
_CAPPABLE = frozenset().union(*(flags for _, flags in _ONEDNN_LEVELS)) - {"avx", "fma", "f16c"}
# ATen's ATEN_CPU_CAPABILITY values: "default" (no vector kernels), "avx2", "avx512"
_ATEN_LEVELS = {"default": "AVX", "avx2": "AVX2", "avx512": "AVX512_CORE_VNNI"}


@dataclass(frozen=True)
class CpuIsa:
    """The CPU's model name and the ISA flags the kernels may use (after ``ONEDNN_MAX_CPU_ISA`` /
    ``ATEN_CPU_CAPABILITY`` caps)."""

    name: str  # /proc/cpuinfo's "model name"
    flags: frozenset[str]  # lower-case /proc/cpuinfo flags, capped
    capped_by: str | None = None  # "ONEDNN_MAX_CPU_ISA=AVX2" when a cap removed flags

    def has_native(self, dtype: str) -> bool:
        """Whether ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"``) computes natively here."""
        if dtype == "bfloat16":
            return bool(self.flags & set(NATIVE_BF16_FLAGS))
        if dtype == "float16":
            return bool(self.flags & set(NATIVE_FP16_FLAGS))
        return True

    def summary(self) -> str:
        """``"<model name> (avx2, avx512f, avx512_bf16, amx_bf16)"``: the name and the dtype-relevant
        flags, e.g. for a benchmark's header."""
        names = [f for f in SUMMARY_FLAGS if f in self.flags] or ["no avx2"]
        cap = f"; capped by {self.capped_by}" if self.capped_by else ""
        return f"{self.name} ({', '.join(names)}{cap})"


def cpu_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s ``model name``; the platform's processor elsewhere)."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return _platform.processor() or _platform.machine()


@functools.lru_cache(maxsize=1)
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _raw_flags() -> frozenset[str]:
    override = os.environ.get(FLAGS_ENV)
    if override is not None:
        return frozenset(override.replace(",", " ").lower().split())
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].lower().split())
    return frozenset()


def _cap(flags: frozenset[str], level: str) -> frozenset[str]:
    """``flags`` without those above oneDNN ISA ``level`` (unknown levels cap nothing)."""
    names = [name for name, _ in _ONEDNN_LEVELS]
    if level not in names:
        return flags
    above = frozenset().union(*(f for _, f in _ONEDNN_LEVELS[names.index(level) + 1:]))
    return flags - (above & _CAPPABLE)


def cpu_isa() -> CpuIsa:
    """This CPU's :class:`CpuIsa`, read now (environment changes between calls are seen).

    Caps applied: ``ONEDNN_MAX_CPU_ISA`` (a oneDNN level name such as ``AVX2``, ``AVX512_CORE_BF16``;
    ``DEFAULT``/``ALL`` cap nothing) and ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``).
    """
    raw = _raw_flags()
    flags, caps = raw, []
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).strip().upper()
    if onednn and _cap(flags, onednn) != flags:
        flags = _cap(flags, onednn)
        caps.append(f"ONEDNN_MAX_CPU_ISA={onednn}")
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if aten in _ATEN_LEVELS and _cap(flags, _ATEN_LEVELS[aten]) != flags:
        flags = _cap(flags, _ATEN_LEVELS[aten])
        caps.append(f"ATEN_CPU_CAPABILITY={aten}")
    return CpuIsa(cpu_name(), flags, ", ".join(caps) or None)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model runs in and why (``metrics.json``'s ``dtype`` and ``dtype_reason``)."""

    dtype: str  # float32 | bfloat16 | float16
    reason: str
    emulated: bool = False  # an explicit 16-bit dtype this CPU has no instructions for (slow)


def choose_dtype(requested: str, checkpoint: str, device: str, isa: CpuIsa | None = None) -> DtypeChoice:
    """Resolve ``dtype`` for ``device``: ``"auto"`` -> the checkpoint's dtype, except a 16-bit dtype on a CPU
    without native instructions for it, which runs in float32; an explicit dtype is obeyed (``emulated``
    says when a CPU lacks its instructions).

    Args:
        requested: ``"auto"``, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        checkpoint: the checkpoint's dtype (``config.json``; see ``model_loader.checkpoint_dtype``).
        device: ``"cpu"`` or ``"cuda[:N]"``; GPUs keep the checkpoint's dtype.
        isa: the CPU's ISA (default :func:`cpu_isa`).

    Returns:
        A :class:`DtypeChoice`.
    """
    on_cpu = not device.startswith("cuda")
    if requested != "auto":
        if on_cpu and requested != "float32":
            isa = isa or cpu_isa()
            if not isa.has_native(requested):
                flags = NATIVE_BF16_FLAGS if requested == "bfloat16" else NATIVE_FP16_FLAGS
                return DtypeChoice(requested, f"dtype={requested} as asked; emulated on {isa.summary()}, which has "
                                   f"none of {', '.join(flags)}: float32 runs several times faster here "
                                   "(dtype=auto picks it)", emulated=True)
        return DtypeChoice(requested, f"dtype={requested} as asked")
    if not on_cpu or checkpoint == "float32":
        return DtypeChoice(checkpoint, f"dtype=auto: {checkpoint}, the checkpoint's config.json")
    isa = isa or cpu_isa()
    if isa.has_native(checkpoint):
        return DtypeChoice(checkpoint, f"dtype=auto: {checkpoint}, the checkpoint's config.json "
                           f"({isa.summary()} computes {checkpoint} natively)")
    flags = NATIVE_BF16_FLAGS if checkpoint == "bfloat16" else NATIVE_FP16_FLAGS
    return DtypeChoice("float32", f"dtype=auto: float32 for a {checkpoint} checkpoint: {isa.summary()} has none "
                       f"of {', '.join(flags)}, so {checkpoint} would be emulated (several times slower); "
                       f"model.dtype={checkpoint} forces it")
