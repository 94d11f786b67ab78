"""``executor=ray`` on a local Ray cluster (skipped when the ``ray`` extra is not installed): stories260K
sharded over two tensor-parallel ranks, Ray actors in a placement group, runs the mixed workload of
``test_mp.py`` (chunked prefill, prefix caching, swap preemption, n-gram drafts, a JSON-schema
request) with transformers' greedy tokens; the actors of one host use the shared-memory collectives;
a killed actor fails every request with the engine-dead error at once (the driver gathers the ranks one
by one: rank 0, waiting in a collective with the dead rank, is not waited for), a stopped one within the
heartbeat timeout (its pings go unanswered). CI installs Ray core (scripts/bootstrap.sh)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from executor_workload import ENGINE, check_every_feature_at_once
from helpers import STORIES, STORY_PROMPTS, resources_gone

from framework import LLM, SamplingParams
from framework.interfaces import EngineDeadError
from framework.testing.fault_injection import worker_pid

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_llm():
    llm = LLM(executor="ray", tensor_parallel_size=2, executor_params={"num_cpus_per_worker": 0.5}, **ENGINE)
    yield llm
    llm.engine.shutdown()
    assert not ray.is_initialized()  # the executor started the local cluster, so it stopped it


def test_greedy_parity_with_every_feature_at_once_on_two_ray_ranks(ray_llm):
    check_every_feature_at_once(ray_llm, "executor=ray")
    # each rank's paged cache holds its 2 of the 4 KV heads: K and V, 5 layers, 8 slots, head 8, float32
    assert ray_llm.engine.executor.collective_rpc("kv_cache_bytes_per_block") == [2 * 5 * 8 * 2 * 8 * 4] * 2
    assert [i["communicator"] for i in ray_llm.engine.executor.collective_rpc("rank_info")] == ["shm"] * 2
    ray_llm.engine.check_health()


def test_killed_actor_fails_every_request(ray_llm):
    """Kills the module's engine: keep this test last."""
    engine = ray_llm.engine
    for i in range(3):
        engine.add_request(str(i), STORY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.step()
    ray.kill(engine.executor.actors[1])
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="executor=ray lost a worker") as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 10  # not rank 0's wait in the collective
    assert sorted(o.request_id for o in info.value.outputs) == ["0", "1", "2"]
    assert all(o.error for o in info.value.outputs)


@pytest.mark.isolated  # timing: a heartbeat or deadline of seconds must not meet another test's load
def test_stopped_actor_is_lost_within_the_heartbeat_timeout():
    """SIGSTOP of rank 1 mid-run: its ping on the ``health`` concurrency group goes unanswered; before, the
    driver waited for the 300 s execute timeout."""
    llm = LLM(model=STORIES, attention="torch", max_model_len=128, executor="ray", tensor_parallel_size=2,
              executor_params={"num_cpus_per_worker": 0.5, "heartbeat_timeout_s": 3})
    engine = llm.engine
    pids = engine.executor.collective_rpc(worker_pid)
    for i in range(2):
        engine.add_request(str(i), STORY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    engine.step()
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker rank 1 answered no ping"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 3 + 4
    assert resources_gone(pids, within_s=20) and not ray.is_initialized()
