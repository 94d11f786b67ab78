"""Inductor's vector-ISA probes are answered from the machine's record after the first process probed them
(``framework/compilation/vec_isa.py``): the same answer, no subprocess."""

from __future__ import annotations

import json
import platform

import pytest

from framework.compilation import vec_isa

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector ISAs only")


def test_a_probe_is_run_once_then_read_from_the_record(tmp_path, monkeypatch):
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv("SERVELAB_CACHE", str(tmp_path))
    assert vec_isa.install() and vec_isa.install()  # idempotent
    avx2 = cpu_vec_isa.VecAVX2()
    probed = avx2.check_build(cpu_vec_isa.VecISA._avx_code)  # a real probe: build, then dlopen in a subprocess
    record = json.loads(vec_isa.probes_path().read_text())
    assert list(record.values()) == [probed]

    def no_subprocess(self, output_path):
        raise AssertionError("probed again instead of reading the record")

    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", no_subprocess)
    assert avx2.check_build(cpu_vec_isa.VecISA._avx_code) is probed
    other_code = cpu_vec_isa.VecISA._avx_code + "\n// another program\n"
    with pytest.raises(AssertionError, match="probed again"):  # a different probe is not answered by this one
        avx2.check_build(other_code)
