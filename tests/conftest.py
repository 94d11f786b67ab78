"""Shared fixtures: offline env, model paths, an LLM factory that checks KV blocks return to the pool,
and a cached transformers greedy oracle."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

from helpers import STORIES, assert_all_blocks_free  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests without CUDA, naming what they would check."""
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: would check {item.name}"))


@pytest.fixture(scope="session", autouse=True)
def eager_unless_asked() -> Iterator[None]:
    """``engine.compile=auto`` stays eager in tests (the break-even is out of reach), so the suite does
    not compile as a test's tokens add up; compilation tests pass ``compile=True`` or patch
    ``framework.engine.compile_policy.COMPILE_BREAK_EVEN_TOKENS`` themselves. Subprocess runs
    (``run.py``) keep the real rule: their workloads are far below it, and servers pass
    ``engine.compile=false``."""
    from framework.engine import compile_policy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compile_policy, "COMPILE_BREAK_EVEN_TOKENS", 1 << 62)
        yield


@pytest.fixture
def make_llm() -> Iterator[Callable]:
    """Factory ``make_llm(model=STORIES, **kwargs) -> LLM``; after the test, asserts no KV block leaked."""
    from framework import LLM

    made = []

    def factory(model: str = STORIES, **kwargs):
        llm = LLM(model=model, **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        assert_all_blocks_free(llm.engine)


@pytest.fixture(scope="session")
def random_weight_stories(tmp_path_factory) -> str:
    """Path of a random-weight stories260K-shaped model with its byte-fallback tokenizer (built once)."""
    from helpers import make_random_weight_model

    return make_random_weight_model(tmp_path_factory.mktemp("random_stories"))
