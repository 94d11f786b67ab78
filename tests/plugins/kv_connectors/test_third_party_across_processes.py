"""A third-party KV connector package, found only through its ``servelab.plugins`` entry point (a dist-info on the
path of a temporary folder, not installed into the environment), is loaded and runs in the processes the engine
starts: the ``executor=mp`` worker ranks (``check_kv_connector_engine`` at ``tensor_parallel_size=2`` passes,
token-exact) and the engine-core process (``MPCoreClient``, the server's engine core), also when the fork server
that starts them was running before the package appeared (a child gets the launcher's ``sys.path`` and builds its
plugin registry afresh). The package's connector is ``shared_storage`` under another name that also marks, per
process, which role it was built for."""

from __future__ import annotations

import asyncio
import os
import textwrap
from pathlib import Path

import pytest
from helpers import STORIES, STORY_PROMPTS

from framework import LLM, registry
from framework.config import EngineConfig
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.distributed.process_start import child_launch, process_context
from framework.testing.kv_connector_engine import check_kv_connector_engine

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

PLUGIN = '''
"""A third-party package's plugin module: ``kv_connector=kvprobe``."""
from pathlib import Path
import os

from framework import hookimpl
from plugins.kv_connectors.shared_storage import SharedStorageConnector


class ProbeConnector(SharedStorageConnector):
    """shared_storage that touches ``<markers>/<role>-<tp_rank>-<pid>`` once it knows its shard."""

    name = "kvprobe"
    interface_version = 1

    def __init__(self, markers, **params):
        super().__init__(**params)
        self._markers = Path(markers)
        if self.role.name == "SCHEDULER":
            (self._markers / f"SCHEDULER-0-{os.getpid()}").touch()

    def register_kv_caches(self, kv_caches, backend):
        super().register_kv_caches(kv_caches, backend)
        (self._markers / f"WORKER-{self.kv_shard.tp_rank}-{os.getpid()}").touch()


@hookimpl
def register_kv_connectors(register):
    register("kvprobe", ProbeConnector)
'''


@pytest.fixture
def kvprobe(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """The package on ``sys.path`` and ``PYTHONPATH`` (children see it either way), a fresh plugin manager for this
    test only; yields ``(store folder, markers folder)``."""
    child_launch(process_context())  # a fork server started before the package appeared (as after earlier tests)
    site = tmp_path / "site"
    (site / "servelab_kvprobe").mkdir(parents=True)
    (site / "servelab_kvprobe" / "__init__.py").write_text("")
    (site / "servelab_kvprobe" / "plugin.py").write_text(textwrap.dedent(PLUGIN))
    dist = site / "servelab_kvprobe-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: servelab-kvprobe\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[servelab.plugins]\nservelab_kvprobe = servelab_kvprobe.plugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(registry, "_plugin_manager", None)  # rebuilt from the entry points, this one's included
    assert "kvprobe" in registry.available("kv_connector")
    store, markers = tmp_path / "kv", tmp_path / "markers"
    store.mkdir()
    markers.mkdir()
    return store, markers


def _marks(markers: Path, role: str) -> list[tuple[int, int]]:
    """``(tp_rank, pid)`` of every process that built ``role``'s side."""
    return sorted((int(p.name.split("-")[1]), int(p.name.split("-")[2])) for p in markers.glob(f"{role}-*"))


def test_entry_point_connector_passes_the_engine_kit_in_mp_worker_ranks(kvprobe):
    store, markers = kvprobe
    check_kv_connector_engine("kvprobe", STORIES, connector_params={"path": str(store), "markers": str(markers)},
                              executor="mp", tensor_parallel_size=2)
    workers = _marks(markers, "WORKER")
    assert [rank for rank, _ in workers] == [0, 0, 1, 1], workers  # producer and consumer engines, two ranks each
    assert os.getpid() not in {pid for _, pid in workers} and len({pid for _, pid in workers}) == 4
    assert {pid for _, pid in _marks(markers, "SCHEDULER")} == {os.getpid()}  # the driver's scheduler side


def test_entry_point_connector_runs_in_the_engine_core_process(kvprobe):
    from framework.engine.async_llm import AsyncLLM
    from framework.engine.core_client import MPCoreClient

    store, markers = kvprobe
    prompts = STORY_PROMPTS[:2]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    engine = dict(model=STORIES, dtype="float32", compile=False, block_size=4, max_model_len=128)
    want = [o.outputs[0].token_ids for o in LLM(**engine).generate(prompts, greedy)]
    config = EngineConfig(**engine, seed=0, kv_connector="kvprobe", kv_role="kv_producer",
                          kv_connector_params={"path": str(store), "markers": str(markers)})
    client = MPCoreClient(config)
    llm = AsyncLLM.from_clients([client])
    try:
        client.wait_for_hello(120)

        async def collect(prompt) -> list[int]:
            tokens: list[int] = []
            params = SamplingParams(temperature=0.0, max_tokens=8, output_kind=RequestOutputKind.DELTA)
            async for out in llm.generate(prompt, params):
                tokens += out.outputs[0].token_ids
            return tokens

        async def run():
            return [await collect(p) for p in prompts]

        assert asyncio.run(run()) == want
        core_pid = client.process.pid
    finally:
        llm.shutdown()
    assert _marks(markers, "SCHEDULER") == [(0, core_pid)] and _marks(markers, "WORKER") == [(0, core_pid)]
    assert list(store.glob("*.safetensors")), "the core's connector stored no block"
