"""KV connectors under ``executor=ray`` (skipped when the ``ray`` extra is not installed): stories260K's stages as Ray
actors (``pipeline_parallel_size=2``), each actor's worker side moving its own layers' part of every block, every
rank's report merged by the executor with the aggregator ``executor=mp`` uses. A ``shared_storage`` consumer on Ray
loads what an ``executor=mp`` producer of the same layout stored, and ``offload`` turns hit the CPU tier, float32
greedy token-exact against one plain engine. One local Ray cluster serves the module."""

from __future__ import annotations

import pytest
from kv_conversations import TIGHT, assert_no_leak, conversations, greedy_run

from framework import LLM

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

ray = pytest.importorskip("ray")

RAY_PP2 = dict(executor="ray", pipeline_parallel_size=2, executor_params={"num_cpus_per_worker": 0.5})
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play",
           "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """One local cluster for the module's engines (an executor that finds Ray running neither starts nor stops it)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _count_reports(llm):
    """How many ranks' worker-side reports the executor merged, per step (filled as the engine runs)."""
    merged, aggregate = [], llm.engine.executor.kv_outputs.aggregate
    llm.engine.executor.kv_outputs.aggregate = lambda outs: merged.append(sum(o is not None for o in outs)) or \
        aggregate(outs)
    return merged


def test_shared_storage_ray_pp2_consumer_loads_an_mp_producers_stages_exactly(tmp_path):
    plain = greedy_run(PROMPTS)[0]
    params = {"kv_connector": "shared_storage", "kv_connector_params": {"path": str(tmp_path)}}
    assert greedy_run(PROMPTS, executor="mp", pipeline_parallel_size=2, **params, kv_role="kv_producer") == (plain, 0)
    assert list(tmp_path.glob("*.pp1of2.layers3-5.safetensors"))
    tokens, hits = greedy_run(PROMPTS, **RAY_PP2, **params, kv_role="kv_consumer")
    assert tokens == plain and hits > 0


def test_offload_ray_pp2_turns_hit_the_cpu_tier_and_stay_exact():
    expected = conversations(LLM(**TIGHT))
    llm = LLM(**TIGHT, **RAY_PP2, kv_connector="offload", kv_connector_params={"cpu_bytes": 1 << 20})
    try:
        reports = _count_reports(llm)
        assert conversations(llm) == expected
        assert reports and set(reports) == {2}, "every step must merge both stages' reports"
        assert llm.engine.metrics.summary()["external_prefix_cache_hits"] > 0
        assert_no_leak(llm)
    finally:
        llm.engine.shutdown()
