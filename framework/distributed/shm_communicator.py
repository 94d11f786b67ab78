"""Shared-memory collectives for tensor-parallel ranks on one CPU host (``parallel.communicator=shm``).

Why: gloo's all-reduce costs ~0.3-2 ms per call on a 2-core VM whatever the size (a hand-off
through its worker and event-loop threads, each a futex wake-up of a possibly idle vCPU), and a
decoder makes ``1 + 2 * num_layers`` of them per step: 62 for SmolLM2, half of a TP=2 batch-64
decode step (``experiments/offline/bench_parallel.py``). vLLM's CPU backend (``csrc/cpu/shm.cpp``, used by
its ``CpuCommunicator``) and SGLang's CPU path replace gloo inside a host the same way; gloo stays
the group's transport for everything else (start-up, objects, barriers) and across hosts.

Protocol: one segment holds an int64 sequence counter per rank and, per rank, two data slots of
``slot_bytes`` (even and odd sequence numbers). A collective is one or more chunks; for each chunk
every rank bumps its counter, copies its chunk into its slot of that parity, publishes the counter,
waits until every counter reached the same value, then reads the other ranks' slots. A slot is
rewritten two chunks later, which no rank can reach before every rank has published the chunk in
between, i.e. finished reading this one: no second barrier is needed. Every rank sums the slots in
rank order (in float32 for 16-bit floats), so all ranks get bitwise the same result.

Waiting spins for :data:`SPIN_BEFORE_YIELD` reads of the counters, then yields the core
(``time.sleep(0)``) between reads, so ranks that outnumber the cores (TP=3 on 2 cores) and the
driver process still run.
"""

from __future__ import annotations

import contextlib
import os
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

from framework.distributed.shm_segment import attach_shared_memory, memory_fence, owned_name, sweep_stale_segments

SPIN_BEFORE_YIELD = 50  # counter reads before the waiting rank yields its core between reads
_HEADER_BYTES = 64  # the ranks' int64 counters (room for 8 ranks; more get their own header size)
_ALIGN = 64


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class ShmCommunicator:
    """All-reduce, all-gather and gather over one shared-memory segment for the ranks of one host.

    Construct it on every rank of an initialised ``torch.distributed`` group (a collective call:
    rank 0 creates the segment, sends its name over the group, every rank attaches, and rank 0
    removes the name at once, so nothing is left under ``/dev/shm`` once construction returned). The
    name is an owned one (``framework.distributed.shm_segment.owned_name``: ``servelab_<pid>_...``) and
    rank 0 first sweeps those of dead creators, so a group SIGKILLed between create and unlink leaves a
    segment only until the next start.

    Args:
        rank: this rank in ``group``; world_size: the group's size (every rank on this host).
        group: the ``torch.distributed`` process group used once, to share the segment's name.
        slot_bytes: bytes of one data slot; larger tensors go through in chunks (default 4 MiB;
            the segment is ``2 * world_size * slot_bytes`` plus a header).
        timeout_s: seconds a rank waits for the others before :class:`RuntimeError` (a rank died
            or hangs; the executor normally notices the death first).

    Raises:
        RuntimeError: the segment could not be created or attached.
    """

    def __init__(self, rank: int, world_size: int, group: object, slot_bytes: int = 4 << 20,
                 timeout_s: float = 120.0) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.slot_bytes = _round_up(slot_bytes, _ALIGN)
        self.timeout_s = timeout_s
        header = _round_up(max(_HEADER_BYTES, 8 * world_size), _ALIGN)
        size = header + 2 * world_size * self.slot_bytes
        name = [None]
        if rank == 0:
            sweep_stale_segments()
            self._shm = SharedMemory(create=True, size=size, name=owned_name("tp"))
            self._shm.buf[:header] = bytes(header)
            name = [self._shm.name]
        dist.broadcast_object_list(name, group_src=0, group=group)  # group_src: a stage's TP subgroup too
        if rank != 0:
            self._shm = attach_shared_memory(name[0])
        dist.barrier(group=group)
        if rank == 0:
            self._shm.unlink()  # the mappings stay; the name goes, so a killed group leaves nothing behind
        dist.barrier(group=group)  # every rank returns with the name gone
        self._counters = np.ndarray((world_size,), dtype=np.int64, buffer=self._shm.buf[:8 * world_size])
        data = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=2 * world_size * self.slot_bytes,
                                offset=header)
        # slots[parity][rank]: a uint8 view of that slot
        self._slots = [[data[(2 * r + parity) * self.slot_bytes:(2 * r + parity + 1) * self.slot_bytes]
                        for r in range(world_size)] for parity in range(2)]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._seq = 0
        self.num_calls = 0  # collectives run (tests, benchmarks)

    # ---- the protocol ---------------------------------------------------------------------
    def _publish(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Copy ``chunk`` (contiguous, 1-D, at most ``slot_bytes``) into this rank's slot, wait for
        every rank's chunk of this step; returns every rank's chunk (views into the segment, valid
        until this rank publishes twice more)."""
        self._seq += 1
        seq, n = self._seq, chunk.numel()
        slots = self._typed_slots(chunk.dtype)[seq & 1]
        slots[self.rank][:n].copy_(chunk)
        memory_fence()  # the data before the counter
        self._counters[self.rank] = seq
        self._wait(seq)
        return [slot[:n] for slot in slots]

    def _typed_slots(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """``[parity][rank]``: the slots viewed as ``dtype`` (cached per dtype)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = [[slot.view(dtype) for slot in row] for row in self._slots]
        return typed

    def _wait(self, seq: int) -> None:
        """Until every rank's counter reached ``seq``.

        Raises:
            RuntimeError: ``timeout_s`` passed (checked every 4096 reads once yielding), naming the late ranks.
        """
        counters, spins, deadline = self._counters, 0, None
        while counters.min() < seq:
            spins += 1
            if spins > SPIN_BEFORE_YIELD:
                time.sleep(0)
                if spins % 4096 == 0:
                    deadline = deadline or time.monotonic() + self.timeout_s
                    if time.monotonic() > deadline:
                        late = [r for r in range(self.world_size) if counters[r] < seq]
                        raise RuntimeError(f"rank {self.rank}: shared-memory collective waited {self.timeout_s:.0f} s "
                                           f"for ranks {late} (pid {os.getpid()}): a rank died or hangs; "
                                           "parallel.communicator=torch_distributed uses gloo instead")
        memory_fence()  # the other ranks' data after their counters

    def _chunks(self, flat: torch.Tensor) -> list[tuple[int, int]]:
        step = self.slot_bytes // flat.element_size()
        return [(start, min(start + step, flat.numel())) for start in range(0, max(flat.numel(), 1), step)]

    # ---- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks: a new tensor of ``x``'s shape and dtype, bitwise equal on
        every rank (summed in rank order; float16/bfloat16 sums of more than two ranks accumulate in
        float32, and two are one correctly rounded add)."""
        self.num_calls += 1
        flat = x.contiguous().view(-1)
        if flat.numel() * flat.element_size() <= self.slot_bytes:  # the common case: one chunk
            return self._sum(self._publish(flat)).view(x.shape)
        out = torch.empty_like(flat)
        for start, stop in self._chunks(flat):
            out[start:stop] = self._sum(self._publish(flat[start:stop]))
        return out.view(x.shape)

    def _sum(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) == 2:
            return torch.add(parts[0], parts[1])  # a new tensor; 16-bit floats round once, as an fp32 sum would
        dtype = parts[0].dtype
        acc = parts[0].to(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype, copy=True)
        for part in parts[1:]:
            acc += part
        return acc.to(dtype)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape and dtype on every rank), in rank order, on every rank."""
        return self._gather(x, keep=True)

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's ``x`` in rank order on rank ``dst``; ``None`` on the others."""
        return self._gather(x, keep=self.rank == dst)

    def _gather(self, x: torch.Tensor, keep: bool) -> list[torch.Tensor] | None:
        self.num_calls += 1
        flat = x.contiguous().view(-1)
        outs = [torch.empty_like(flat) for _ in range(self.world_size)] if keep else None
        for start, stop in self._chunks(flat):
            parts = self._publish(flat[start:stop])
            if outs is not None:
                for out, part in zip(outs, parts):
                    out[start:stop] = part
        return None if outs is None else [out.view(x.shape) for out in outs]

    def close(self) -> None:
        """Unmap the segment in this process (its name is already gone)."""
        self._counters = None
        self._slots, self._typed = [], {}
        with contextlib.suppress(BufferError):  # a view still alive in this process: the mapping goes with it
            self._shm.close()
