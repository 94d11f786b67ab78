"""Shared fixtures: offline env, model paths, an LLM factory that checks KV blocks return to the pool,
and a cached transformers greedy oracle."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# Triton kernels (attention=triton) run on CPU tensors in Triton's interpreter, which must be chosen before
# triton is first imported (torch.compile imports it); a CUDA machine keeps compiled kernels
if "TRITON_INTERPRET" not in os.environ and not __import__("torch").cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from helpers import STORIES, assert_all_blocks_free  # noqa: E402

XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if "PYTEST_XDIST_WORKER" in os.environ:  # pytest -n N: N test processes share the cores
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS))  # and subprocesses


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test process takes its share of the cores (torch intra-op threads)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def xdist_isolation(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``isolated`` (it checks machine-wide state such as ``/dev/shm``, or
    timing on the scale of seconds: heartbeats, deadlines)
    runs while no other test does: a readers-writer lock over two files shared by the test processes
    (every test holds the main lock shared, an isolated one exclusively; the turnstile lets a waiting
    isolated test in before new shared holders, so it cannot starve). Serial runs skip it."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    import fcntl
    import tempfile
    from pathlib import Path

    base = Path(tempfile.gettempdir()) / f"servelab-xdist-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}"
    exclusive = request.node.get_closest_marker("isolated") is not None
    with open(f"{base}.turnstile", "a+") as turnstile, open(f"{base}.lock", "a+") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests without CUDA, naming what they would check."""
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: would check {item.name}"))


@pytest.fixture(scope="session", autouse=True)
def eager_unless_asked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``engine.compile=auto`` stays eager in tests (``CompilePlanner.decide`` says so without
    measuring), so the suite does not compile as a test's tokens add up; compilation tests pass
    ``compile=True``, and ``tests/framework/engine/test_compile_policy.py`` restores the planner. The
    compile calibration records of this process and its subprocesses go to a temporary folder
    (``$SERVELAB_COMPILE_RECORDS``: steps timed on a loaded test machine must not become the user's
    numbers). Subprocess runs (``run.py``) keep the real rule: their workloads are far below any
    saving, and servers pass ``engine.compile=false``."""
    from framework.engine import compile_calibration
    from framework.engine.compile_policy import CompileDecision

    eager = CompileDecision(False, "engine.compile=auto: eager (the test suite keeps auto eager, tests/conftest.py)")
    calibration = tmp_path_factory.mktemp("compile-calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVELAB_COMPILE_RECORDS", str(calibration))  # subprocesses (run.py, servers) record there too
        mp.setattr(compile_calibration, "calibration_dir", lambda: calibration)
        mp.setattr(compile_calibration.CompilePlanner, "decide",
                   lambda self, planned, *args, **kwargs: compile_calibration.decide_compile("auto", None) if planned is None
                   else eager)
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
