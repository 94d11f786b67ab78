"""``parallel.data_parallel_size=N`` with ``router=NAME``: N engines behind one front (offline ``LLM`` and the
offline runner), every request answered exactly once, greedy outputs equal one engine's, a dead replica fails
only its own requests; with ``executor=sim`` a discrete-event loop over simulated replicas."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from helpers import STORIES
from sim_helpers import linear_profile

from framework import LLM, SamplingParams, build_engine
from framework.config import EngineConfig
from framework.core.faults import EngineDeadError
from framework.engine.data_parallel import DataParallelEngine
from framework.entrypoints.offline_runner import run_workload
from framework.workloads.synthetic import apply_arrivals, shared_prefix_workload

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(4 + 3 * i)] for i in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# routing and failure semantics are the same whichever way replicas step: these tests take turns in one process
# (executor=auto's worker processes cost seconds per replica to start; one test below runs them)
UNIPROC = "uniproc"


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of one engine."""
    llm = LLM(model=STORIES, compile=False, num_blocks=256, block_size=4)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("router", ["round_robin", "cache_aware", "prefix_score"])
def test_two_replicas_answer_each_request_once_with_one_engines_outputs(reference, router):
    llm = LLM(model=STORIES, compile=False, num_blocks=256, block_size=4, data_parallel_size=2, router=router,
              executor=UNIPROC)
    assert isinstance(llm.engine, DataParallelEngine) and len(llm.engine.replicas) == 2
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.request_id for o in outputs] == [str(i) for i in range(len(PROMPTS))]
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    assert sum(llm.engine.num_routed) == len(PROMPTS)
    if router == "round_robin":
        assert llm.engine.num_routed == [4, 4]
    assert not llm.engine.has_unfinished_requests()
    for replica in llm.engine.replicas:
        assert replica.kv_allocator.num_free_blocks == replica.kv_allocator.num_blocks
    summary = llm.engine.metrics.summary()
    assert summary["data_parallel_size"] == 2 and summary["router"] == router
    assert summary["num_requests"] == len(PROMPTS)
    assert [r["num_requests"] for r in summary["replicas"]] == llm.engine.num_routed


def test_cpu_replicas_compute_at_once_each_in_worker_processes_on_its_own_cores(reference):
    """Offline CPU replicas (``executor=auto``): each replica's rank in a worker process pinned to its
    ``replica_cpus`` (this process's affinity untouched), and one front step steps every busy replica,
    with speculative decoding (ngram) and structured output running in each replica."""
    from framework import StructuredOutputsParams
    from framework.distributed.parallel_state import replica_cpus
    from framework.testing.fault_injection import worker_pid

    mine = os.sched_getaffinity(0)
    llm = LLM(model=STORIES, compile=False, num_blocks=256, block_size=4, data_parallel_size=2, router="round_robin",
              executor="auto", drafter="ngram", drafter_params={"num_speculative_tokens": 3}, grammar="xgrammar")
    engine = llm.engine
    assert [r.config.executor for r in engine.replicas] == ["mp", "mp"] and engine.concurrent
    assert os.sched_getaffinity(0) == mine
    pids = [r.executor.collective_rpc(worker_pid)[0] for r in engine.replicas]
    assert [os.sched_getaffinity(pid) for pid in pids] == [set(replica_cpus(i, 2)) for i in range(2)]
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)  # round robin: one on each replica
    assert {o.request_id for o in engine.step()} == {"a", "b"}  # both replicas stepped in one front step
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert [outputs["a"], outputs["b"]] == reference[:2]  # greedy: speculation leaves the tokens as they were
    choices = ["Once upon a time", "The little dog"]
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=choices))
    outs = llm.generate([PROMPTS[4], PROMPTS[5]], [constrained, GREEDY])  # one on each replica, at once
    assert outs[0].outputs[0].text in choices and list(outs[1].outputs[0].token_ids) == reference[5]
    # a replica whose step raises on its pool thread fails only its own request; the other one finishes
    engine.replicas[1].step = lambda: (_ for _ in ()).throw(RuntimeError("injected fault in replica 1"))
    engine.add_request("c", PROMPTS[2], GREEDY)
    engine.add_request("d", PROMPTS[3], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.alive == [True, False] and "replica 1 died" in done["d"].error and done["c"].error is None
    assert list(done["c"].outputs[0].token_ids) == reference[2]
    engine.shutdown()


DRIVER = """
import sys
sys.path[:0] = [{repo!r}]
from framework import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(model={model!r}, compile=False, num_blocks=256, block_size=4, data_parallel_size=2, executor="auto")
    print("READY", *[p for r in llm.engine.replicas for p in r.executor.worker_pids], flush=True)
    while True:
        llm.generate(["Once upon a time"] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
"""


def test_a_killed_driver_leaves_no_replica_worker_and_no_segment(tmp_path):
    """SIGKILL of the process holding offline replicas mid-generate: every replica's worker processes exit
    (each dies with its parent) and no ``/dev/shm`` name the driver or a worker mapped is left (the rings are
    memfds: nothing named at all)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from helpers import REPO, mapped_shm, resources_gone

    script = tmp_path / "dp_forever.py"
    script.write_text(DRIVER.format(repo=str(REPO), model=STORIES))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        pids = [int(p) for p in line.split()[1:]]
        names = mapped_shm([proc.pid, *pids])  # the segments in use (the suite runs alongside: no folder diff)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # generous: other tests load the CPUs meanwhile
        assert resources_gone(pids, sorted(names), within_s=30), ([p for p in pids if Path(f"/proc/{p}").exists()],
                                                                  [n for n in names if (Path("/dev/shm") / n).exists()])
    finally:
        proc.kill()


def test_a_dead_replica_fails_only_its_requests_and_is_never_chosen_again(reference):
    llm = LLM(model=STORIES, compile=False, num_blocks=256, block_size=4, data_parallel_size=2, router="round_robin",
              executor=UNIPROC)
    doomed = llm.engine.replicas[1]
    real_step = doomed.step

    def failing_step():
        if doomed.num_steps >= 2:
            raise RuntimeError("injected fault in replica 1's forward")
        return real_step()

    doomed.step = failing_step
    outputs = llm.generate(PROMPTS, GREEDY)
    assert len(outputs) == len(PROMPTS) and all(o.finished for o in outputs)
    failed = [i for i, o in enumerate(outputs) if o.error is not None]
    assert failed == [1, 3, 5, 7]  # round robin sent the odd requests to replica 1
    assert all("replica 1 died" in outputs[i].error and outputs[i].outputs[0].finish_reason == "abort" for i in failed)
    assert [list(outputs[i].outputs[0].token_ids) for i in (0, 2, 4, 6)] == [reference[i] for i in (0, 2, 4, 6)]
    assert llm.engine.alive == [True, False]
    again = llm.generate(PROMPTS[:3], GREEDY)  # the survivor serves everything now
    assert [list(o.outputs[0].token_ids) for o in again] == reference[:3] and all(o.error is None for o in again)
    assert llm.engine.num_routed == [7, 4]


def test_the_last_replica_dying_kills_the_engine():
    llm = LLM(model=STORIES, compile=False, num_blocks=256, block_size=4, data_parallel_size=2, router="round_robin",
              executor=UNIPROC)
    for replica in llm.engine.replicas:
        replica.step = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS[:4], GREEDY)


def test_an_unknown_router_is_refused_before_any_replica_loads():
    from framework.registry import UnknownPluginError

    with pytest.raises(UnknownPluginError, match="cache_aware"):
        build_engine(EngineConfig(model=STORIES, data_parallel_size=2, router="nope"))


def _sim_run(tmp_path, router: str, replicas: int = 3) -> dict:
    profile = linear_profile(tmp_path / "profile.json", 0.01, prefill_tokens=1e-4)
    engine = build_engine(EngineConfig(model=STORIES, compile=False, executor="sim", executor_params={"profile": profile},
                                       data_parallel_size=replicas, router=router, block_size=16, num_blocks=96))
    items = apply_arrivals(shared_prefix_workload(num_prefixes=4, questions_per_prefix=8, prefix_len=96,
                                                  question_len=16, output_len=8, vocab_size=engine.vocab_size, seed=0),
                           {"request_rate": 40.0}, seed=0)
    records, summary = run_workload(engine, items, SamplingParams(max_tokens=8, ignore_eos=True), progress=False)
    assert all(r.executor.run_labels()["simulated"] for r in engine.replicas)
    engine.shutdown()
    assert len(records) == len(items) and all(r["error"] is None for r in records)
    assert Counter(r["request_id"] for r in records) == Counter(i.request_id for i in items)
    return summary


def test_simulated_replicas_run_on_virtual_time_and_cache_aware_routing_hits_the_prefix_cache(tmp_path):
    rr, cache = _sim_run(tmp_path, "round_robin"), _sim_run(tmp_path, "cache_aware")
    assert rr["simulated"] and rr["data_parallel_size"] == 3
    assert sum(r["num_routed"] for r in rr["replicas"]) == 32
    assert cache["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"]


def test_compile_budgets_are_dealt_round_robin_to_the_replicas(monkeypatch):
    llm = LLM(model=STORIES, compile=False, num_blocks=256, block_size=4, data_parallel_size=2, router="round_robin",
              executor=UNIPROC)
    told = {0: [], 1: []}
    for i, replica in enumerate(llm.engine.replicas):
        monkeypatch.setattr(replica, "maybe_compile",
                            lambda budgets, repeats=1, i=i, r=replica: told[i].append((budgets, repeats)) or r.compile_decision)
    llm.engine.maybe_compile([1, 2, 3, 4, 5], repeats=2)
    llm.engine.maybe_compile(None)
    assert told == {0: [([1, 3, 5], 2), (None, 1)], 1: [([2, 4], 2), (None, 1)]}
