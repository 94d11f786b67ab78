"""Inductor's on-disk cache keeps each vector ISA's code apart (``decoder.cpu_simdlen``).

Found by a stale cache: the TP=2 EAGLE test of ``test_mp.py`` generated all-zero tokens in a checkout whose
``/tmp/torchinductor_root`` held the same graphs compiled as AVX-512 code, loaded under
``ATEN_CPU_CAPABILITY=avx2`` (the FX graph key had no ISA in it; the C++ was rebuilt with AVX2 flags)."""

from __future__ import annotations

import pytest
import torch

from framework.compilation import vec_isa
from framework.compilation.decoder import cpu_simdlen, inductor_config


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _compile_and_run(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``_rms_norm`` compiled through inductor with the engine's config patches; (output, FX cache hits)."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()
    cpu_simdlen.cache_clear()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    fn = torch.compile(_rms_norm, backend=lambda gm, ex: compile_fx(gm, ex, config_patches=inductor_config(ex)))
    return fn(x, w), counters["inductor"]["fxgraph_cache_hit"] - hits


def test_cpu_graphs_pin_the_vector_width_inductor_picks():
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    cpu_simdlen.cache_clear()
    assert inductor_config([torch.ones(2)])["cpp.simdlen"] == pick_vec_isa().bit_width()
    assert "cpp.simdlen" not in inductor_config([torch.ones(2, device="meta"), 3])  # no CPU tensor: no CPU code


def test_a_graph_cached_as_avx512_code_is_not_loaded_under_avx2(monkeypatch):
    """Before: the second compile hit the first's entry and returned NaN."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch._inductor.utils import fresh_cache

    vec_isa.install()
    if not any(str(isa) == "avx512" for isa in valid_vec_isa_list()):  # what the CPU and compiler build, uncapped
        pytest.skip("needs a CPU and compiler that build AVX-512 code, to cache a graph as AVX-512 first")

    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(64)
    want = _rms_norm(x, w)
    try:
        with fresh_cache():
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
            first, _ = _compile_and_run(x, w)
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
            second, hits = _compile_and_run(x, w)
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
            third, hits_again = _compile_and_run(x, w)
    finally:
        cpu_simdlen.cache_clear()
        torch._dynamo.reset()
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(second, want)
    torch.testing.assert_close(third, want)
    assert (hits, hits_again) == (0, 1)  # its own entry per ISA, each found again
