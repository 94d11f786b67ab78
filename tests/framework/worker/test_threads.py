"""Torch threads of a rank in a process of its own (``parallel.num_threads_per_rank=0``): the cores split over
the ranks, at most ``$OMP_NUM_THREADS`` where the user set it."""

from __future__ import annotations

import os

import pytest

from framework.worker.worker import default_num_threads


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})


@pytest.mark.parametrize(("omp", "tp", "threads"), [(None, 1, 4), (None, 2, 2), (None, 8, 1), ("1", 1, 1),
                                                    ("3", 1, 3), ("8", 2, 2), ("", 2, 2), ("x", 1, 4), ("0", 1, 4)])
def test_cores_split_over_ranks_capped_by_omp_num_threads(four_cores, monkeypatch, omp, tp, threads):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert default_num_threads(tp) == threads
