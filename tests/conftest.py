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

pytest_plugins = ["xdist_schedule"]  # file order and isolation under pytest-xdist (tests/xdist_schedule.py)

XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if "PYTEST_XDIST_WORKER" in os.environ:  # pytest -n N: N test processes share the cores
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS))  # and subprocesses


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each test process takes its share of the cores (torch intra-op threads)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the test files for pytest-xdist (``xdist_schedule.order_files``); skip ``gpu``-marked tests
    without CUDA, naming what they would check."""
    import torch
    from xdist_schedule import order_files

    order_files(items)
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs CUDA: would check {item.name}"))


#: resident memory growth (bytes) since the last collection that makes the suite collect garbage after a test
GC_AFTER_GROWTH_BYTES = 1 << 30
_rss_after_gc = [0]


def _rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@pytest.fixture(autouse=True)
def collect_garbage_when_memory_grows() -> Iterator[None]:
    """A safety net under ``tests/framework/engine/test_engine_release.py``: an object a test leaves in a reference
    cycle (a model, a KV cache) lives until Python's next full collection, which with torch loaded can be many
    tests later; a pytest worker grew to 16 GB that way and was killed for memory. After a test that grew this
    process by a GiB the suite collects (reading the RSS costs microseconds; a collection ~0.1 s)."""
    yield
    if _rss_bytes() - _rss_after_gc[0] > GC_AFTER_GROWTH_BYTES:
        import gc

        gc.collect()
        _rss_after_gc[0] = _rss_bytes()


@pytest.fixture(scope="session", autouse=True)
def eager_unless_asked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``engine.compile=auto`` stays eager in tests (``CompilePlanner.decide`` says so without
    measuring), so the suite does not compile as a test's tokens add up; compilation tests pass
    ``compile=True``, and ``tests/framework/compilation/test_policy.py`` restores the planner. The
    compile calibration records of this process and its subprocesses go to a temporary folder
    (``$SERVELAB_COMPILE_RECORDS``: steps timed on a loaded test machine must not become the user's
    numbers). Subprocess runs (``run.py``) keep the real rule: their workloads are far below any
    saving, and servers pass ``engine.compile=false``."""
    from framework.compilation import calibration as compile_calibration
    from framework.compilation.policy import CompileDecision

    eager = CompileDecision(False, "engine.compile=auto: eager (the test suite keeps auto eager, tests/conftest.py)")
    calibration = tmp_path_factory.mktemp("compile-calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVELAB_COMPILE_RECORDS", str(calibration))  # subprocesses (run.py, servers) record there too
        mp.setattr(compile_calibration, "calibration_dir", lambda: calibration)
        mp.setattr(compile_calibration.CompilePlanner, "decide",
                   lambda self, planned, *args, **kwargs: compile_calibration.decide_compile("auto", None) if planned is None
                   else eager)
        yield


@pytest.fixture(scope="module")
def eager_paged_kernel() -> Iterator[None]:
    """``torch_paged`` runs its kernel eager in the engines this module builds (in this process and in their worker
    and engine-core processes, which get the config) unless a test sets ``attention_params["compile"]`` itself.

    For modules about something else (an executor, a parallel layout, a KV connector, a server): the kernel's
    compile costs every process ~1-4 s of dynamo tracing even with inductor's cache warm (~25 s cold), a quarter
    of ``test_mp.py``'s time, and is not what they check. The eager kernel is the same function (it runs where
    no compiler is), so what they check still holds; the compiled kernel is tested in
    ``tests/plugins/attention/test_torch_paged.py`` and by every module that does not use this fixture. Use it
    with ``pytestmark = pytest.mark.usefixtures("eager_paged_kernel")``; module scope, so that module-scoped
    engines are built under it."""
    from framework.config import EngineConfig

    post_init = EngineConfig.__post_init__

    def eager_kernel_unless_set(self: EngineConfig) -> None:
        if self.attention == "torch_paged" and "compile" not in self.attention_params:
            self.attention_params = {**self.attention_params, "compile": False}
        post_init(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineConfig, "__post_init__", eager_kernel_unless_set)
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
