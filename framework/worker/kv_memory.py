"""KV cache memory: zero-filled tensors whose pages the OS commits when first written.

``torch.zeros`` writes every byte of a KV cache at start-up: a 1 GiB CPU cache costs ~0.4 s of one core
(more on a loaded machine, ~3 s measured with the test suite running) before the first request, and every
page stays resident even if the run uses a hundred blocks. An anonymous ``mmap`` is zero-filled by the
kernel (POSIX ``mmap(2)``: ``MAP_ANONYMOUS`` contents are initialized to zero) and commits a page on its
first write, so the cache still reads as zeros everywhere (a never-written slot read by a masked-out
kernel lane is 0, not garbage or NaN) while start-up costs microseconds and resident memory follows the
blocks actually used. This is how the OS already hands out large ``malloc`` blocks; the mmap makes the
zeros a guarantee rather than an accident of the allocator. The cost moves, page by page, to the step
that first writes a block (the same total, spread over the run). CUDA and other devices keep
``torch.zeros`` (device memory has no demand paging to lean on).
"""

from __future__ import annotations

import math
import mmap

import torch


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor of ``shape`` and ``dtype`` on ``device``.

    On CPU its storage is a private anonymous memory map (page-aligned, zero-filled by the kernel, each
    page committed on first write); the tensor keeps the map alive. Elsewhere: ``torch.zeros``.

    Args:
        shape: the tensor's shape (any rank; an empty product gives an empty tensor).
        dtype: any torch dtype (float8 included: the map is viewed as ``dtype``).
        device: ``torch.device`` or its name.

    Returns:
        A contiguous, writable tensor of zeros.

    Raises:
        OSError: the kernel refused the mapping (address space or ``vm.overcommit_memory=2`` limits): the
            message is the OS's; a smaller ``kv_cache_memory_bytes`` is the fix.
    """
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
