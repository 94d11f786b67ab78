"""Building and loading the plugins' C++ kernels (``plugins/*/csrc/*.cpp``).

Each kernel is plain C++ with a C ABI (no torch headers): the machine's compiler (``$CXX``, else ``g++``) builds it
on first use in about a second (a torch extension takes ~40 s) into ``$SERVELAB_CACHE/kernels/<stem>-<hash>.so``,
the hash covering the source, the flags and the compiler, and ``ctypes`` loads it. A missing compiler, a failed
build or an unwritable cache is not an error: the caller gets ``(None, why)`` and takes its torch path, logging why.
Threads come from OpenMP (``-fopenmp``): the process has torch's libgomp loaded already, and the dynamic linker
reuses it by soname, so the kernels share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def build_kernel(source: Path, flags: tuple[str, ...]) -> tuple[ctypes.PyDLL | None, str]:
    """The library built from ``source`` with ``flags``, or ``(None, why not)``.

    Built at most once per source, flags and compiler; concurrent builders (test workers, ranks) each write a
    private file and rename it into place. Loaded as ``ctypes.PyDLL``: calls hold the GIL, as torch's ops do
    (the kernels are short; handing the GIL to another thread and back on each call cost more).

    Args:
        source: the ``.cpp`` file. flags: compiler flags (``-shared -fPIC`` among them).
    """
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None, "no C++ compiler (set CXX or install g++)"
    from framework.model_executor.model_loader import servelab_cache_dir

    digest = hashlib.sha256(source.read_bytes() + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    folder = servelab_cache_dir() / "kernels"
    path = folder / f"{source.stem}-{digest}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            return None, f"cannot write the built kernel under {folder}: {e}"
        try:
            proc = subprocess.run([compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                                  timeout=300, check=False)
            if proc.returncode:
                return None, f"building {source.name} with {compiler} failed: {proc.stderr.strip()[-500:]}"
            os.replace(tmp, path)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"building {source.name} with {compiler} failed: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        logger.info("built %s: %s", source.name, path)
    try:
        return ctypes.PyDLL(str(path)), ""
    except OSError as e:
        return None, f"loading {path} failed: {e}"
