"""This process's parallel groups (``framework/distributed/parallel_state.py``).

Two spawned gloo ranks build the TP group twice in one world: with ``communicator=auto`` (two CPU
ranks of one host: the shared-memory communicator, registered under the group's name) and with
``torch_distributed``; the getters, ``ensure_model_parallel_initialized``, the group's collectives,
the refusals and the teardown are checked there. The data-parallel description and the CPU split
run in this process (no process group).
"""

from __future__ import annotations

import os
import threading
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from helpers import run_ranks

from framework.distributed import parallel_state as ps


def _refusal(fn, *args) -> str:  # noqa: ANN001 - a callable and its arguments
    try:
        fn(*args)
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return "no error"


def _tp_case(world: int, communicator: str) -> dict:
    """Build the TP group, use it, tear it down (every rank runs this)."""
    from framework.distributed import communication_op

    tp = ps.initialize_model_parallel(world, "cpu", communicator, timeout_s=60)
    x = torch.full((2, 3), float(tp.rank_in_group + 1))
    gathered = tp.gather(x)
    out = {"fields": (tp.unique_name, tp.ranks, tp.world_size, tp.num_local_ranks, tp.is_first_rank),
           "getters": (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                       ps.get_tp_group() is tp, ps.ensure_model_parallel_initialized(world) is tp),
           "communicator": type(tp.communicator).__name__,
           "registered": (tp.group_name in communication_op._SHM_COMMUNICATORS,
                          communication_op._SHM_COMMUNICATORS.get(tp.group_name) is tp.communicator),
           "sum": tp.all_reduce(x).tolist(), "all_gather": tp.all_gather(x).tolist(),
           "gather": None if gathered is None else gathered.tolist(),
           "twice": _refusal(ps.initialize_model_parallel, world),
           "other_size": _refusal(ps.ensure_model_parallel_initialized, world + 1)}
    name = tp.group_name
    ps.destroy_model_parallel()
    out["after"] = (ps.model_parallel_is_initialized(), name in communication_op._SHM_COMMUNICATORS, tp.communicator)
    return out


def _rank(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    try:
        import torch.distributed as dist

        torch.set_num_threads(1)
        out = {"before_init": _refusal(ps.initialize_model_parallel, world)}
        ps.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60)
        ps.init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", "gloo")  # joined already: no-op
        out["other_world"] = _refusal(ps.init_distributed_environment, world + 1, rank, None)
        out["wrong_size"] = _refusal(ps.initialize_model_parallel, world + 1)
        out["auto"] = _tp_case(world, "auto")
        out["torch_distributed"] = _tp_case(world, "torch_distributed")
        ps.destroy_distributed_environment()
        out["world_left"] = not dist.is_initialized()
        queue.put((rank, out))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, {"traceback": traceback.format_exc()}))


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, dict]:
    return run_ranks(_rank, 2)


@pytest.mark.parametrize("communicator", ["auto", "torch_distributed"])
def test_the_tp_group_is_the_engines_world(two_ranks, communicator):
    for rank, res in two_ranks.items():
        case = res[communicator]
        assert case["fields"] == ("tp", [0, 1], 2, 2, rank == 0)
        assert case["getters"] == (rank, 2, True, True)
        assert case["sum"] == [[3.0] * 3] * 2
        assert case["all_gather"] == [[1.0] * 3 + [2.0] * 3] * 2
        assert case["gather"] == ([[1.0] * 3 + [2.0] * 3] * 2 if rank == 0 else None)


def test_auto_puts_cpu_ranks_of_one_host_on_shared_memory(two_ranks):
    for res in two_ranks.values():
        assert (res["auto"]["communicator"], res["auto"]["registered"]) == ("ShmCommunicator", (True, True))
        assert (res["torch_distributed"]["communicator"], res["torch_distributed"]["registered"]) == ("NoneType",
                                                                                                   (False, True))


def test_refusals_name_the_fix(two_ranks):
    res = two_ranks[0]
    assert "init_distributed_environment" in res["before_init"]
    assert "already initialised as rank 0 of 2, asked for rank 0 of 3" in res["other_world"]
    assert "world has 2 ranks, asked for a TP group of 3" in res["wrong_size"]
    assert "destroy_model_parallel() first" in res["auto"]["twice"]
    assert "has 2 ranks, asked for 3" in res["auto"]["other_size"]


def test_teardown_unregisters_the_communicator_and_leaves_the_world(two_ranks):
    for res in two_ranks.values():
        for communicator in ("auto", "torch_distributed"):
            assert res[communicator]["after"] == (False, False, None)
        assert res["world_left"]


def test_getters_refuse_without_groups():
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(RuntimeError, match="a one-rank engine has none"):
        ps.get_tp_group()
    with pytest.raises(RuntimeError, match="no tensor-parallel group"):
        ps.get_tensor_model_parallel_world_size()
    with pytest.raises(RuntimeError, match="no data-parallel group"):
        ps.get_dp_group()
    with pytest.raises(ValueError, match="communicator must be one of"):
        ps.initialize_model_parallel(2, communicator="nccl_shm")


def test_replica_cpus_are_disjoint_slices_of_the_cores():
    cores = (7, 0, 1, 2, 3, 4, 5, 6)
    slices = [ps.replica_cpus(r, 3, cores) for r in range(3)]
    assert slices == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [ps.replica_cpus(r, 4, (0, 1)) for r in range(4)] == [(0,), (1,), (0,), (1,)]  # more replicas than cores
    assert set(ps.replica_cpus(0, 1)) == os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\)"):
        ps.replica_cpus(2, 2, cores)


def test_the_dp_group_describes_this_replica_and_can_pin_it():
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    seen = {}

    def replica() -> None:  # a thread of its own: pinning changes only the calling thread's affinity
        group = ps.initialize_data_parallel(1, 2, pin=True)
        seen.update(group=group, affinity=os.sched_getaffinity(0), got=ps.get_dp_group())

    try:
        worker = threading.Thread(target=replica)
        worker.start()
        worker.join()
        group = seen["group"]
        assert (group.dp_rank, group.dp_size, group.rank_in_group, group.world_size) == (1, 2, 1, 2)
        assert group.cpus == ps.replica_cpus(1, 2, cpus) and seen["affinity"] == set(group.cpus)
        assert seen["got"] is group
        with pytest.raises(RuntimeError, match="already runs data-parallel replica 1 of 2"):
            ps.initialize_data_parallel(0, 2)
    finally:
        ps.destroy_model_parallel()
    with pytest.raises(RuntimeError, match="no data-parallel group"):
        ps.get_dp_group()
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\)"):
        ps.initialize_data_parallel(2, 2, cpus=(0,))
