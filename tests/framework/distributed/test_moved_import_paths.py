"""What moved into ``framework/distributed/`` (issue 49) is still importable from where it was, as the
same objects (not copies: a communicator registered through one path is the one the other sees)."""

from __future__ import annotations

import importlib

import pytest

MOVED = [  # (old module, new module, names)
    ("framework.worker.shm_communicator", "framework.distributed.shm_communicator",
     ["ShmCommunicator", "attach_shared_memory", "memory_fence", "SPIN_BEFORE_YIELD"]),
    ("framework.worker.parallel_layers", "framework.distributed.communication_op",
     ["set_communicator", "all_reduce", "all_gather_last_dim", "gather_last_dim_to_driver", "shm_all_reduce",
      "shm_all_gather", "DRIVER_RANK"]),
    ("framework.worker.worker", "framework.distributed.parallel_state", ["DISTRIBUTED_TIMEOUT_S"]),
]


@pytest.mark.parametrize(("old", "new", "names"), MOVED, ids=[m[0] for m in MOVED])
def test_old_and_new_paths_give_the_same_objects(old: str, new: str, names: list[str]) -> None:
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(old_module, name) is getattr(new_module, name), f"{old}.{name} is not {new}.{name}"


def test_the_old_module_says_where_things_went() -> None:
    old = importlib.import_module("framework.worker.shm_communicator")
    assert "framework.distributed.shm_communicator" in old.__doc__
    assert sorted(old.__all__) == sorted(MOVED[0][2])

