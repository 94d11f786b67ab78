"""The collectives of a tensor-parallel group, called by the group's name (vLLM's ``communication_op``).

The tensor-parallel layers (``framework/model_executor/parallel_layers.py``) hold their group's
``group_name`` (``ProcessGroup.group_name``: a string, so a compiled graph carries it as a constant)
and call :func:`all_reduce`, :func:`all_gather_last_dim` and :func:`gather_last_dim_to_driver` with
it. Each goes through the group's communicator: ``torch.distributed._functional_collectives`` (gloo
on CPU, NCCL on CUDA), which dynamo traces, or, for CPU ranks on one host, the shared-memory
:class:`~framework.distributed.shm_communicator.ShmCommunicator` registered with
:func:`set_communicator` (``parallel.communicator``; ``parallel_state.initialize_model_parallel``
registers it), behind the opaque custom ops ``servelab::shm_all_reduce`` / ``servelab::shm_all_gather``.
Either way a compiled decoder keeps its collectives inside the graph (``fullgraph`` holds).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

DRIVER_RANK = 0  # the rank that receives the full logits (vLLM's driver worker)
#: group name -> its shared-memory communicator (``ShmCommunicator``); groups not here use torch.distributed
_SHM_COMMUNICATORS: dict[str, Any] = {}


def set_communicator(group_name: str, communicator: Any | None) -> None:
    """Route the collectives of the group ``group_name`` through ``communicator`` (a
    :class:`~framework.distributed.shm_communicator.ShmCommunicator`); ``None`` goes back to
    ``torch.distributed``. Called once the group is initialised, before any forward."""
    if communicator is None:
        _SHM_COMMUNICATORS.pop(group_name, None)
    else:
        _SHM_COMMUNICATORS[group_name] = communicator


@torch.library.custom_op("servelab::shm_all_reduce", mutates_args=())
def shm_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``ShmCommunicator.all_reduce`` as an opaque op, so a compiled graph calls it (fake: same shape)."""
    return _SHM_COMMUNICATORS[group_name].all_reduce(x)


@shm_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("servelab::shm_all_gather", mutates_args=())
def shm_all_gather(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Every rank's ``x (..., n)`` concatenated along the last dim -> ``(..., world_size * n)``."""
    return torch.cat(_SHM_COMMUNICATORS[group_name].all_gather(x), dim=-1)


@shm_all_gather.register_fake
def _(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], world_size * x.shape[-1])


def _wait(t: torch.Tensor) -> torch.Tensor:
    # eager funcol returns an AsyncCollectiveTensor; under dynamo the wait is a graph node inductor places
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of ``x`` over the group (traceable); a new tensor of ``x``'s shape and dtype."""
    shm = _SHM_COMMUNICATORS.get(group_name)
    if shm is not None:
        return shm_all_reduce(x, group_name) if torch.compiler.is_compiling() else shm.all_reduce(x)
    return _wait(funcol.all_reduce(x, "sum", group_name))


def all_gather_last_dim(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``(..., n)`` on each of ``tp`` ranks -> ``(..., tp * n)`` in rank order, on every rank."""
    shm = _SHM_COMMUNICATORS.get(group_name)
    if shm is not None:
        return shm_all_gather(x.contiguous(), group_name, shm.world_size)
    return _wait(funcol.all_gather_single(x.contiguous(), gather_dim=x.dim() - 1, group=group_name))


def gather_last_dim_to_driver(x: torch.Tensor, group_name: str, tp_rank: int, tp_size: int) -> torch.Tensor | None:
    """Eager only: ``(..., n)`` on each rank -> ``(..., tp * n)`` on the driver rank, ``None`` on the
    others (``(tp - 1) / tp`` of the data crosses ranks, not all of it as in an all-gather)."""
    shm = _SHM_COMMUNICATORS.get(group_name)
    x = x.contiguous()
    if shm is not None:
        parts = shm.gather(x, DRIVER_RANK)
    else:
        parts = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == DRIVER_RANK else None
        dist.gather(x, parts, group=dist.distributed_c10d._resolve_process_group(group_name), group_dst=DRIVER_RANK)
    return None if parts is None else torch.cat(parts, dim=-1)
