"""The shared-memory collectives of CPU tensor-parallel ranks (``parallel.communicator=shm``).

Three spawned ranks (gloo for start-up) run every collective with a 4 KiB slot, so large tensors go
through in many chunks and the two slot parities are reused many times: sums equal the rank-order
sum bitwise on every rank (float32, bfloat16 through a float32 accumulator, int64), gathers return
every rank's tensor; the segment's name is gone from ``/dev/shm`` as soon as the group is built; a
rank that never joins a collective makes the others fail within the timeout, naming it. The ranks
also run the collectives inside a ``torch.compile(fullgraph=True)`` function (the custom ops).
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp
from helpers import run_ranks

SLOT_BYTES = 4096


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _rank_order_sum(world: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    parts = [_inputs(r, shape, dtype) for r in range(world)]
    if world == 2:
        return parts[0] + parts[1]
    acc = parts[0].to(torch.float32 if dtype == torch.bfloat16 else dtype, copy=True)
    for part in parts[1:]:
        acc += part
    return acc.to(dtype)


def _rank(rank: int, world: int, port: int, queue: mp.Queue, case: str) -> None:
    try:
        import torch.distributed as dist

        from framework.distributed import communication_op
        from framework.distributed.shm_communicator import ShmCommunicator

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        comm = ShmCommunicator(rank, world, dist.group.WORLD, slot_bytes=SLOT_BYTES,
                               timeout_s=2.0 if case == "timeout" else 60.0)
        segments = sorted(os.listdir("/dev/shm"))
        out: dict = {"segments": segments, "name": comm._shm.name}
        if case == "collectives":
            for shape, dtype in [((3,), torch.float32), ((64, 576), torch.bfloat16), ((1000,), torch.float32),
                                 ((7, 300), torch.int64), ((0,), torch.float32)]:
                got = comm.all_reduce(_inputs(rank, shape, dtype))
                out[f"sum {shape} {dtype}"] = (got.dtype == dtype and got.shape == shape
                                              and torch.equal(got, _rank_order_sum(world, shape, dtype)))
            x = _inputs(rank, (5, 333), torch.bfloat16)
            everyone = [_inputs(r, (5, 333), torch.bfloat16) for r in range(world)]
            out["all_gather"] = all(torch.equal(a, b) for a, b in zip(comm.all_gather(x), everyone))
            gathered = comm.gather(x, dst=1)
            out["gather"] = (gathered is None) if rank != 1 else all(torch.equal(a, b) for a, b in zip(gathered, everyone))
            out["num_calls"] = comm.num_calls
            group = dist.group.WORLD.group_name
            communication_op.set_communicator(group, comm)

            def f(x: torch.Tensor) -> torch.Tensor:
                return communication_op.all_gather_last_dim(communication_op.all_reduce(x * 2, group) + 1, group)

            x = _inputs(rank, (4, 8), torch.float32)
            compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
            compiled(x)  # traced: the fake implementations run
            before = comm.num_calls
            y = compiled(x)
            out["compiled_calls"] = comm.num_calls - before
            out["compiled"] = torch.equal(y, f(x))
        elif case == "timeout" and rank == 0:
            try:
                comm.all_reduce(torch.ones(4))
            except RuntimeError as exc:
                out["error"] = str(exc)
        if case == "timeout":
            dist.barrier()  # rank 1 waits here until rank 0 gave up
        comm.close()
        dist.destroy_process_group()
        queue.put((rank, out))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put((rank, {"traceback": traceback.format_exc()}))


def _run(world: int, case: str) -> dict[int, dict]:
    return run_ranks(_rank, world, case)


@pytest.fixture(scope="module")
def three_ranks() -> dict[int, dict]:
    return _run(3, "collectives")


def test_sums_equal_the_rank_order_sum_bitwise_on_every_rank(three_ranks):
    for rank, res in three_ranks.items():
        sums = {k: v for k, v in res.items() if k.startswith("sum")}
        assert len(sums) == 5 and all(sums.values()), (rank, sums)


def test_gathers_return_every_ranks_tensor(three_ranks):
    assert all(res["all_gather"] and res["gather"] for res in three_ranks.values())
    assert {res["num_calls"] for res in three_ranks.values()} == {7}


def test_the_segment_name_is_gone_once_the_group_is_built(three_ranks):
    name = three_ranks[0]["name"].lstrip("/")
    assert all(name not in res["segments"] for res in three_ranks.values())


def test_two_rank_sum_of_bfloat16_is_one_correctly_rounded_add():
    a, b = _inputs(0, (64, 576), torch.bfloat16), _inputs(1, (64, 576), torch.bfloat16)
    assert torch.equal(a + b, (a.float() + b.float()).to(torch.bfloat16))  # what the 2-rank fast path relies on


def test_collectives_compile_as_custom_ops_in_one_graph(three_ranks):
    assert all(res["compiled"] for res in three_ranks.values())
    assert {res["compiled_calls"] for res in three_ranks.values()} == {2}  # the compiled call ran the shm ops


def test_a_rank_that_never_joins_fails_the_others_naming_it():
    results = _run(2, "timeout")
    assert "waited 2 s for ranks [1]" in results[0]["error"]
    assert "parallel.communicator=torch_distributed" in results[0]["error"]
