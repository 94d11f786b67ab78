"""Moved to :mod:`framework.distributed.shm_communicator` (issue 49: the process groups and the
communicators live in ``framework/distributed/``). This module re-exports its public names so that
``from framework.worker.shm_communicator import ShmCommunicator`` keeps working; new code imports
from ``framework.distributed``."""

from __future__ import annotations

from framework.distributed.shm_communicator import (
    SPIN_BEFORE_YIELD,
    ShmCommunicator,
    attach_shared_memory,
    memory_fence,
)

__all__ = ["SPIN_BEFORE_YIELD", "ShmCommunicator", "attach_shared_memory", "memory_fence"]
