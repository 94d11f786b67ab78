"""``engine.tune_malloc``: after ``tune_malloc()`` a step's freed multi-MiB activations stay in the
heap and the next step reuses them instead of page-faulting fresh memory in."""

from __future__ import annotations

import platform
import resource

import pytest
import torch
from helpers import STORIES

from framework import LLM
from framework.model_executor.cpu_malloc import tune_malloc

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds are glibc's")


def _faults_of_a_step() -> int:
    """Minor page faults of one "step": 8 live 6 MiB buffers (a prefill chunk's MLP activations),
    then all freed; measured after 3 warm-up steps."""
    def step() -> None:
        buffers = [torch.empty(6 << 20, dtype=torch.uint8).fill_(1) for _ in range(8)]
        del buffers

    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_activations_are_reused_without_page_faults():
    """Untuned glibc trims the 48 MiB freed at the heap top after each step (its adaptive trim
    threshold is 2x the largest freed buffer), so every step faults ~12,000 pages in again."""
    assert tune_malloc()
    assert _faults_of_a_step() < 256


def test_engine_knob():
    llm = LLM(model=STORIES, tune_malloc=False)
    assert llm.config.tune_malloc is False
