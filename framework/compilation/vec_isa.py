"""Inductor's CPU vector-ISA probes, answered once per machine instead of once per process.

Before inductor generates or loads C++ code in a process it asks which vector ISA the CPU and the compiler
support (``torch._inductor.cpu_vec_isa``): for each candidate (AVX2, AVX-512, AVX-512 VNNI/BF16, AMX, AMX-FP16)
``VecISA.check_build`` compiles a tiny program and dlopens it in a fresh Python subprocess. That is ~10
subprocesses and ~2 s in every process that compiles anything (measured: 2.1 s of a 7.2 s torch_paged warm-up on
a 2-core Xeon with inductor's cache warm), and every ``mp`` rank, engine-core process and server pays it again.
The answer only depends on the machine, so :func:`install` remembers each probe's result in
``$SERVELAB_CACHE/compile/vec_isa_probes.json`` (default ``~/.cache/servelab``), keyed by everything the probe
depends on: the candidate's class and compiler flags, the probed code, the C++ compiler and its version, torch's
version and the CPU's flags. A result not in the file is probed as inductor would and then recorded.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch

from framework.platform import cpu_isa

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_installed = False


def probes_path() -> Path:
    """The probe record: ``$SERVELAB_CACHE/compile/vec_isa_probes.json`` (``~/.cache/servelab`` by default)."""
    return Path(os.environ.get("SERVELAB_CACHE") or Path.home() / ".cache" / "servelab").expanduser() / "compile" / \
        "vec_isa_probes.json"


@functools.cache
def _machine_key() -> str:
    """The compiler (path and version), torch's version and the CPU's flags, hashed."""
    try:
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

        compiler = get_cpp_compiler()
        compiler = f"{compiler} {get_compiler_version_info(compiler)}"
    except Exception:  # noqa: BLE001 - no compiler: inductor will fail on its own; key it anyway
        compiler = "unknown"
    flags = " ".join(sorted(cpu_isa().flags))
    return hashlib.sha256(f"{compiler}|{torch.__version__}|{flags}".encode()).hexdigest()[:16]


def _load() -> dict[str, bool]:
    try:
        record = json.loads(probes_path().read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _save(key: str, ok: bool) -> None:
    """Add one probe's result (atomic replace; concurrent writers may drop each other's entry: re-probed later)."""
    path = probes_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = _load()
        record[key] = ok
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as err:
        logger.debug("vec ISA probe record not saved (%s)", err)


def install() -> bool:
    """Answer inductor's ``VecISA.check_build`` probes from the machine's record (see the module docstring);
    idempotent. Returns False (and changes nothing) when this torch has no such probe to wrap."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from torch._inductor import cpu_vec_isa
        except ImportError:
            return False
        original = getattr(cpu_vec_isa.VecISA, "check_build", None)
        if original is None:
            return False

        @functools.wraps(original)
        def check_build(self: Any, code: str) -> bool:
            flags = self.build_arch_flags() if hasattr(self, "build_arch_flags") else ""
            key = hashlib.sha256(f"{_machine_key()}|{type(self).__name__}|{flags}|{code}".encode()).hexdigest()[:24]
            known = _load().get(key)
            if isinstance(known, bool):
                return known
            ok = bool(original(self, code))
            _save(key, ok)
            return ok

        cpu_vec_isa.VecISA.check_build = check_build
        _installed = True
        return True
