"""This process's parallel groups (vLLM's ``parallel_state``): the tensor-parallel group and the
data-parallel replica it belongs to.

How servelab's parallelism is laid out: an engine (one data-parallel replica) runs its model on
``tensor_parallel_size`` ranks, one process per rank (``executor=mp`` / ``ray``), and those ranks are
the whole ``torch.distributed`` world of that engine; ``parallel.data_parallel_size=N`` runs N such
engines side by side, each with a world of its own. So:

* the **TP group** is a real process group, the engine's world (gloo on CPU, NCCL on CUDA), wrapped
  in a :class:`GroupCoordinator` that also holds the group's communicator (shared memory for CPU
  ranks on one host, ``parallel.communicator``). The worker sets it up in each rank's process:
  :func:`init_distributed_environment`, then :func:`initialize_model_parallel`; it tears it down
  with :func:`destroy_model_parallel`, then :func:`destroy_distributed_environment` (vLLM's order
  and names). A one-rank engine (``executor=uniproc``) has no TP group.
* with ``parallel.pipeline_parallel_size=P`` the world is ``tensor_parallel_size x P`` ranks (vLLM's
  layout: rank ``r`` is TP rank ``r % tp`` of stage ``r // tp``); each stage's ranks form its **TP
  group** and the ranks holding one TP rank in every stage form a **PP group**, the path of the
  stage-to-stage hidden states (``GroupCoordinator.send_next`` / ``recv_prev``; :func:`get_pp_group`).
* the **DP group** is a description, not a process group: replicas never exchange tensors (vLLM's
  DP group syncs MoE dummy batches; no servelab model needs that). A replica's process records
  its place with :func:`initialize_data_parallel`: ``dp_rank``, ``dp_size`` and the CPU cores it
  runs on (:func:`replica_cpus`: disjoint slices of the machine's cores).

The state is per process (module globals, as in vLLM): one TP rank and at most one replica per
process. Replicas built inside one process (``server.engine_process=false``, the offline ``LLM``)
do not record a DP group.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from framework.config import COMMUNICATORS
from framework.distributed import communication_op
from framework.distributed.shm_communicator import ShmCommunicator

#: torch.distributed's and the shared-memory communicator's timeout, seconds: only a backstop (the
#: executor's deadlines find a lost rank first); the worker raises it to the executor's
#: ``compile_timeout_s`` when that is longer (``framework.worker.worker.distributed_timeout_s``).
DISTRIBUTED_TIMEOUT_S = 1800


@dataclass(eq=False)
class GroupCoordinator:
    """One process group as this rank sees it (vLLM's ``GroupCoordinator``): who is in it, its
    ``torch.distributed`` group and its communicator, with the collectives the model layers use.

    The collectives take the tensors of this rank and return a new tensor; they go through
    ``communicator`` when set (shared memory), else through ``torch.distributed`` on ``device_group``.
    """

    unique_name: str  # what the group is for: "tp" or "pp"
    rank: int  # this process's rank in the torch.distributed world
    ranks: list[int]  # world ranks of the group's members, in group order
    rank_in_group: int  # this rank's index in ``ranks``; 0 is the driver rank (it alone samples)
    device_group: Any  # the torch.distributed ProcessGroup (gloo on CPU, NCCL on CUDA)
    num_local_ranks: int  # members on this host (they share its RAM and cores)
    communicator: ShmCommunicator | None = None  # shared-memory collectives; None: torch.distributed's

    @property
    def world_size(self) -> int:
        """Members of the group."""
        return len(self.ranks)

    @property
    def group_name(self) -> str:
        """``ProcessGroup.group_name``: the handle the tensor-parallel layers pass to the collectives."""
        return self.device_group.group_name

    @property
    def is_first_rank(self) -> bool:
        """True on the group's first member (the TP group's driver rank)."""
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the group: same shape and dtype on every member (traceable)."""
        return communication_op.all_reduce(x, self.group_name)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., n)`` of every member -> ``(..., world_size * n)`` in group order, on every member."""
        return communication_op.all_gather_last_dim(x, self.group_name)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Eager only: ``x (..., n)`` of every member -> ``(..., world_size * n)`` on the first member,
        ``None`` on the others."""
        return communication_op.gather_last_dim_to_driver(x, self.group_name, self.rank_in_group, self.world_size)

    def send_next(self, x: torch.Tensor) -> None:
        """Eager, pipeline groups: send ``x`` to the next member (the next stage); blocks until it is taken
        (gloo) or queued (NCCL). Pair with the next member's :meth:`recv_prev` of the same shape and dtype."""
        dist.send(x.contiguous(), group=self.device_group, group_dst=self.rank_in_group + 1)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Eager, pipeline groups: the tensor of ``shape``/``dtype`` the previous member sent (:meth:`send_next`)."""
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, group=self.device_group, group_src=self.rank_in_group - 1)
        return out

    def destroy(self) -> None:
        """Unregister and unmap the communicator; the process group itself is the world's
        (:func:`destroy_distributed_environment`)."""
        if self.communicator is not None:
            communication_op.set_communicator(self.group_name, None)
            self.communicator.close()
            self.communicator = None


@dataclass(frozen=True)
class DataParallelGroup:
    """Which data-parallel replica this process runs (a description: replicas exchange no tensors)."""

    dp_rank: int  # this replica, 0 <= dp_rank < dp_size
    dp_size: int  # replicas behind the front: parallel.data_parallel_size
    cpus: tuple[int, ...]  # CPU cores this replica runs on (its TP ranks split them)

    @property
    def rank_in_group(self) -> int:
        """``dp_rank`` under :class:`GroupCoordinator`'s name."""
        return self.dp_rank

    @property
    def world_size(self) -> int:
        """``dp_size`` under :class:`GroupCoordinator`'s name."""
        return self.dp_size


_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None  # pipeline_parallel_size > 1: this rank's stage-to-stage group
_DP: DataParallelGroup | None = None


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str | None,
                                 backend: str = "gloo", timeout_s: float = DISTRIBUTED_TIMEOUT_S) -> None:
    """Join this engine's ``torch.distributed`` world (its TP ranks); a no-op when already joined as
    ``rank`` of ``world_size``.

    Args:
        world_size: ranks of the engine (``parallel.tensor_parallel_size``); rank: this one.
        distributed_init_method: ``tcp://host:port`` of rank 0's rendezvous (``None``: ``env://``).
        backend: ``gloo`` (CPU) or ``nccl`` (CUDA).
        timeout_s: how long a collective may wait for the other ranks, seconds.

    Raises:
        RuntimeError: this process already belongs to a different world.
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, asked for rank {rank} of {world_size}")
        return
    dist.init_process_group(backend=backend, init_method=distributed_init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def initialize_model_parallel(tensor_model_parallel_size: int, device: str = "cpu", communicator: str = "auto",
                              timeout_s: float = DISTRIBUTED_TIMEOUT_S,
                              pipeline_model_parallel_size: int = 1) -> GroupCoordinator:
    """Make the world the TP group (a collective: every rank calls it) and return it; with
    ``pipeline_model_parallel_size > 1`` the world is TP x PP and each rank gets its stage's TP group and
    its PP group instead (:func:`_initialize_pipeline_groups`).

    Args:
        tensor_model_parallel_size: the world's size (an engine's world is its TP group), or one stage's
            ranks under pipeline parallelism.
        pipeline_model_parallel_size: pipeline stages (``parallel.pipeline_parallel_size``).
        device: the ranks' device type (``cpu`` or ``cuda``).
        communicator: ``parallel.communicator``: ``auto`` (shared memory when every rank is a CPU rank
            of this host, else torch.distributed), ``shm`` (shared memory; every rank on this host)
            or ``torch_distributed`` (gloo / NCCL).
        timeout_s: the shared-memory communicator's wait for the other ranks, seconds.

    Raises:
        RuntimeError: torch.distributed is not initialised, its world is not
            ``tensor_model_parallel_size``, a TP group exists already (:func:`destroy_model_parallel`
            first), or ``communicator=shm`` with ranks on several hosts (names the fix).
        ValueError: an unknown ``communicator``.
    """
    global _TP
    if communicator not in COMMUNICATORS:
        raise ValueError(f"communicator must be one of {list(COMMUNICATORS)}, got {communicator!r}")
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed initialised "
                           "(init_distributed_environment; the executor's worker does it)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if pipeline_model_parallel_size > 1:
        return _initialize_pipeline_groups(tensor_model_parallel_size, pipeline_model_parallel_size, device,
                                           communicator, timeout_s)
    if world_size != tensor_model_parallel_size:
        raise RuntimeError(f"torch.distributed's world has {world_size} ranks, asked for a TP group of "
                           f"{tensor_model_parallel_size}: an engine's world is its TP group (each data-parallel "
                           "replica has a world of its own)")
    if _TP is not None:
        raise RuntimeError("the tensor-parallel group is already initialised; destroy_model_parallel() first")
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    group = GroupCoordinator("tp", rank, list(range(world_size)), rank, dist.group.WORLD,
                             num_local_ranks=hosts.count(socket.gethostname()))
    one_host = group.num_local_ranks == world_size
    if communicator == "shm" and not one_host:
        raise RuntimeError(f"parallel.communicator=shm needs every rank on one host; {group.num_local_ranks} of "
                           f"{world_size} are on this one: use parallel.communicator=torch_distributed")
    if communicator != "torch_distributed" and device == "cpu" and one_host:
        group.communicator = ShmCommunicator(rank, world_size, group.device_group, timeout_s=timeout_s)
        communication_op.set_communicator(group.group_name, group.communicator)
    _TP = group
    return group


def _initialize_pipeline_groups(tp_size: int, pp_size: int, device: str, communicator: str,
                                timeout_s: float) -> GroupCoordinator:
    """The TP x PP layout (vLLM's): world rank ``r`` is TP rank ``r % tp_size`` of stage ``r // tp_size``;
    its TP group is its stage's ranks, its PP group the ranks of every stage with its TP rank (stage order),
    through which it sends its hidden states to the next stage. Every rank creates every group (a
    collective, same order everywhere). The TP group's communicator is chosen as for a plain TP world.

    Raises:
        RuntimeError: the world is not ``tp_size * pp_size``, or the groups exist already.
    """
    global _TP, _PP
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != tp_size * pp_size:
        raise RuntimeError(f"torch.distributed's world has {world_size} ranks, asked for tensor_parallel_size="
                           f"{tp_size} x pipeline_parallel_size={pp_size}")
    if _TP is not None or _PP is not None:
        raise RuntimeError("the model-parallel groups are already initialised; destroy_model_parallel() first")
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    here = socket.gethostname()
    tp_ranks = [[s * tp_size + t for t in range(tp_size)] for s in range(pp_size)]
    pp_ranks = [[s * tp_size + t for s in range(pp_size)] for t in range(tp_size)]
    tp_groups = [dist.new_group(r) for r in tp_ranks]
    pp_groups = [dist.new_group(r) for r in pp_ranks]
    stage, tp_rank = divmod(rank, tp_size)
    tp = GroupCoordinator("tp", rank, tp_ranks[stage], tp_rank, tp_groups[stage],
                          num_local_ranks=sum(hosts[r] == here for r in tp_ranks[stage]))
    pp = GroupCoordinator("pp", rank, pp_ranks[tp_rank], stage, pp_groups[tp_rank],
                          num_local_ranks=sum(hosts[r] == here for r in pp_ranks[tp_rank]))
    one_host = tp.num_local_ranks == tp_size
    if communicator == "shm" and not one_host:
        raise RuntimeError(f"parallel.communicator=shm needs every rank of a stage on one host; {tp.num_local_ranks} "
                           f"of {tp_size} are on this one: use parallel.communicator=torch_distributed")
    if tp_size > 1 and communicator != "torch_distributed" and device == "cpu" and one_host:
        tp.communicator = ShmCommunicator(tp_rank, tp_size, tp.device_group, timeout_s=timeout_s)
        communication_op.set_communicator(tp.group_name, tp.communicator)
    _TP, _PP = tp, pp
    return tp


def get_pp_group() -> GroupCoordinator:
    """This rank's pipeline-parallel group (``rank_in_group``: its stage).

    Raises:
        RuntimeError: none in this process (``pipeline_parallel_size=1``).
    """
    if _PP is None:
        raise RuntimeError("no pipeline-parallel group in this process: initialize_model_parallel(..., "
                           "pipeline_model_parallel_size=N) makes it when parallel.pipeline_parallel_size > 1")
    return _PP


def ensure_model_parallel_initialized(tensor_model_parallel_size: int, device: str = "cpu",
                                      communicator: str = "auto") -> GroupCoordinator:
    """The TP group: the one already initialised (its size checked), else a new one
    (:func:`initialize_model_parallel`, a collective then).

    Raises:
        RuntimeError: the existing group's size differs, or see :func:`initialize_model_parallel`.
    """
    if _TP is None:
        return initialize_model_parallel(tensor_model_parallel_size, device, communicator)
    if _TP.world_size != tensor_model_parallel_size:
        raise RuntimeError(f"the tensor-parallel group has {_TP.world_size} ranks, asked for "
                           f"{tensor_model_parallel_size}")
    return _TP


def model_parallel_is_initialized() -> bool:
    """True once this process is a rank of a TP group."""
    return _TP is not None


def get_tp_group() -> GroupCoordinator:
    """This rank's TP group.

    Raises:
        RuntimeError: none in this process (a one-rank engine has none; a rank's worker makes it).
    """
    if _TP is None:
        raise RuntimeError("no tensor-parallel group in this process: initialize_model_parallel() runs in each rank "
                           "when parallel.tensor_parallel_size > 1 (a one-rank engine has none)")
    return _TP


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in the TP group (0: the driver). Raises as :func:`get_tp_group`."""
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    """Ranks in the TP group. Raises as :func:`get_tp_group`."""
    return get_tp_group().world_size


def replica_cpus(dp_rank: int, dp_size: int, cpus: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The cores replica ``dp_rank`` of ``dp_size`` runs on: ``cpus`` (default: this process's
    affinity) sorted and cut into ``dp_size`` contiguous, disjoint slices, the first
    ``len(cpus) % dp_size`` one core larger. More replicas than cores share them: replica ``r``
    gets core ``r % len(cpus)``.

    Raises:
        ValueError: ``dp_rank`` outside ``[0, dp_size)``, or no cores.
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not cores:
        raise ValueError("no CPU cores to split among the data-parallel replicas")
    if dp_size > len(cores):
        return (cores[dp_rank % len(cores)],)
    per, extra = divmod(len(cores), dp_size)
    start = dp_rank * per + min(dp_rank, extra)
    return tuple(cores[start:start + per + (dp_rank < extra)])


def initialize_data_parallel(dp_rank: int, dp_size: int, cpus: tuple[int, ...] | None = None,
                             pin: bool = False) -> DataParallelGroup:
    """Record that this process runs replica ``dp_rank`` of ``dp_size`` on ``cpus`` (default:
    :func:`replica_cpus` of this process's affinity) and return the description.

    Args:
        pin: also restrict the calling thread to ``cpus`` (``os.sched_setaffinity(0, ...)``): call it
            first thing in the replica's process, so the threads and processes started afterwards (its
            TP ranks) inherit it and split it among themselves (``num_threads_per_rank=0``).

    Raises:
        ValueError: see :func:`replica_cpus`; RuntimeError: a DP group is already recorded
            (:func:`destroy_model_parallel` first).
    """
    global _DP
    if _DP is not None:
        raise RuntimeError(f"this process already runs data-parallel replica {_DP.dp_rank} of {_DP.dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    group = DataParallelGroup(dp_rank, dp_size, tuple(cpus) if cpus is not None else replica_cpus(dp_rank, dp_size))
    if not group.cpus:
        raise ValueError("a data-parallel replica needs at least one CPU core, got cpus=()")
    if pin:
        os.sched_setaffinity(0, group.cpus)
    _DP = group
    return group


def get_dp_group() -> DataParallelGroup:
    """The data-parallel replica this process runs.

    Raises:
        RuntimeError: none recorded (a process that is not one replica: ``data_parallel_size=1``, or
            replicas built in one process).
    """
    if _DP is None:
        raise RuntimeError("no data-parallel group in this process: initialize_data_parallel() runs in a replica's "
                           "own engine process (replicas built in one process record none)")
    return _DP


def destroy_model_parallel() -> None:
    """Forget the TP group (its communicator unregistered and unmapped) and the DP description;
    idempotent. The torch.distributed world stays (:func:`destroy_distributed_environment`)."""
    global _TP, _PP, _DP
    if _TP is not None:
        _TP.destroy()
    _TP, _PP, _DP = None, None, None


def destroy_distributed_environment() -> None:
    """Leave the torch.distributed world (after :func:`destroy_model_parallel`); idempotent."""
    if dist.is_initialized():
        dist.destroy_process_group()
