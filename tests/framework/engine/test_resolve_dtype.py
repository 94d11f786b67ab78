"""``dtype="auto"`` (the default): the checkpoint's ``config.json`` dtype, as vLLM; float32 when it names none,
and float32 for a 16-bit checkpoint on a CPU without native instructions for it (``framework.platform``). The
ISA is faked with ``SERVELAB_CPU_FLAGS`` (and the kernels' caps ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY``
cleared), so each case runs on every machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import STORIES

from framework import EngineConfig
from framework.engine.builder import dtype_choice, resolve_dtype
from framework.model_executor.model_loader import checkpoint_dtype
from framework.platform import CpuIsa, choose_dtype, cpu_isa

AVX2 = "fpu sse4_2 avx avx2 fma f16c"  # AMD Zen 3
AVX512 = AVX2 + " avx512f avx512bw avx512dq avx512vl"  # Skylake-SP: bf16 only emulated
ZEN4 = AVX512 + " avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = ZEN4 + " avx512_fp16 amx_tile amx_bf16 amx_int8"


@pytest.fixture
def fake_isa(monkeypatch):
    """``fake_isa(flags)``: the CPU reads as having ``flags``, with no kernel cap in the environment."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(var, raising=False)
    return lambda flags: monkeypatch.setenv("SERVELAB_CPU_FLAGS", flags)


def _copy_with_dtype(tmp_path, **fields):
    """stories260K's config.json (no weights: only the config is read) with its dtype fields replaced."""
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    config = json.loads((Path(STORIES) / "config.json").read_text())
    del config["dtype"], config["torch_dtype"]
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return str(folder)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"dtype": "bfloat16"}, "bfloat16"),
    ({"torch_dtype": "float16"}, "float16"),  # the name older config files use
    ({}, "float32"),  # names none
    ({"dtype": "float64"}, "float32"),  # outside the engine's dtypes
])
def test_auto_takes_the_checkpoint_dtype(tmp_path, fake_isa, fields, expected):
    fake_isa(SAPPHIRE_RAPIDS)
    config = resolve_dtype(EngineConfig(model=_copy_with_dtype(tmp_path, **fields)))
    assert config.dtype == expected


def test_explicit_dtype_is_kept_and_shipped_models_resolve():
    explicit = EngineConfig(model="/nonexistent/model", dtype="bfloat16")
    assert resolve_dtype(explicit) is explicit  # nothing read from disk
    assert EngineConfig(model=STORIES).dtype == "auto"
    assert resolve_dtype(EngineConfig(model=STORIES)).dtype == "float32"


def test_checkpoint_dtype_reads_torch_dtypes():
    import torch
    from transformers import LlamaConfig

    assert checkpoint_dtype(LlamaConfig(dtype=torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(LlamaConfig()) == "float32"


def test_llm_keeps_the_resolved_config(make_llm):
    llm = make_llm()
    assert llm.config.dtype == llm.engine.config.dtype == "float32"


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16 or float16"):
        EngineConfig(model=STORIES, dtype="fp64")


@pytest.mark.parametrize(("flags", "bf16", "fp16"), [
    (AVX2, "float32", "float32"),
    (AVX512, "float32", "float32"),
    (ZEN4, "bfloat16", "float32"),
    (SAPPHIRE_RAPIDS, "bfloat16", "float16"),
    (AVX2 + " avx_vnni avx_ne_convert", "bfloat16", "float16"),  # Intel client cores (AVX-NE-CONVERT)
])
def test_auto_runs_16_bit_checkpoints_in_float32_without_native_instructions(tmp_path, fake_isa, flags, bf16, fp16):
    fake_isa(flags)
    for fields, expected in (({"dtype": "bfloat16"}, bf16), ({"dtype": "float16"}, fp16)):
        choice = dtype_choice(EngineConfig(model=_copy_with_dtype(tmp_path / fields["dtype"], **fields)))
        assert choice.dtype == expected and not choice.emulated
        assert choice.reason.startswith(f"dtype=auto: {expected}")
        if expected == "float32":  # names what is missing and how to force the checkpoint's dtype
            assert "avx512_bf16" in choice.reason or "avx512_fp16" in choice.reason
            assert f"model.dtype={fields['dtype']} forces it" in choice.reason


def test_an_explicit_dtype_is_obeyed_and_said_to_be_emulated(fake_isa):
    fake_isa(AVX2)
    choice = choose_dtype("bfloat16", "bfloat16", "cpu")
    assert choice.dtype == "bfloat16" and choice.emulated and "emulated" in choice.reason
    assert not choose_dtype("float32", "bfloat16", "cpu").emulated
    fake_isa(ZEN4)
    assert not choose_dtype("bfloat16", "bfloat16", "cpu").emulated
    assert choose_dtype("auto", "bfloat16", "cuda").dtype == "bfloat16"  # GPUs keep the checkpoint's dtype


def test_kernel_caps_in_the_environment_cap_the_isa(fake_isa, monkeypatch):
    """``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (how an AVX-512 machine runs the kernels of an
    AVX2-only CPU) makes the dtype rule see an AVX2-only CPU too."""
    fake_isa(SAPPHIRE_RAPIDS)
    assert cpu_isa().has_native("bfloat16") and cpu_isa().capped_by is None
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    isa = cpu_isa()
    assert not isa.has_native("bfloat16") and not isa.has_native("float16")
    assert isa.capped_by == "ONEDNN_MAX_CPU_ISA=AVX2" and "avx2" in isa.flags
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_isa().has_native("bfloat16") and not cpu_isa().has_native("float16")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not cpu_isa().has_native("bfloat16")
    assert "capped by ATEN_CPU_CAPABILITY=avx2" in cpu_isa().summary()


def test_isa_summary_names_the_cpu_and_its_dtype_flags():
    isa = CpuIsa("AMD EPYC 7B13", frozenset(AVX2.split()))
    assert isa.summary() == "AMD EPYC 7B13 (avx2)"
    assert "amx_bf16" in CpuIsa("Xeon", frozenset(SAPPHIRE_RAPIDS.split())).summary()


def test_metrics_say_the_dtype_and_why(make_llm):
    summary = make_llm().engine.metrics.summary()
    assert summary["dtype"] == "float32"
    assert summary["dtype_reason"] == "dtype=auto: float32, the checkpoint's config.json"


def test_a_simulated_gpu_keeps_the_checkpoint_dtype_on_any_cpu(fake_isa):
    """``executor=sim profile=analytic:h100`` simulates a GPU: its KV pool is sized for bf16 even on an AVX2-only
    host; a profile measured on this CPU (``profile=auto``) follows this CPU's rule."""
    from helpers import REPO

    fake_isa(AVX2)
    llama = str(REPO / "models" / "llama-3-70b")
    gpu = EngineConfig(model=llama, executor="sim", executor_params={"profile": "analytic:h100"})
    assert dtype_choice(gpu).dtype == "bfloat16"
    assert dtype_choice(EngineConfig(model=llama, executor="sim")).dtype == "float32"
