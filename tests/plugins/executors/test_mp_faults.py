"""``executor=mp`` under faults (issue 44): nothing the driver or a rank maps in ``/dev/shm`` still has a name
once the engine is up (the ring is a memfd, the communicator's name goes once every rank attached); calls from
two threads do not interleave on the ring; a stopped rank is lost within the heartbeat timeout, a rank
that hangs in a step within the step deadline, a control call within its own deadline; ``LLM.generate``
shuts the workers down when a step fault kills the engine. Every failure leaves no process behind."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import STORIES, STORY_PROMPTS, mapped_shm, resources_gone

from framework import LLM, SamplingParams
from framework.interfaces import EngineDeadError
from framework.testing.fault_injection import hang_worker, sleep_and_echo

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

SMALL = {"model": STORIES, "attention": "torch", "max_model_len": 128, "executor": "mp"}


@pytest.fixture(scope="module")
def tp2():
    llm = LLM(tensor_parallel_size=2, **SMALL)
    yield llm
    llm.engine.shutdown()


def test_nothing_the_engine_maps_has_a_name_once_it_is_up(tp2):
    """A SIGKILL of the whole group (the resource tracker included) from now on leaves nothing in /dev/shm. Before,
    each rank's wake-up was a named semaphore (``sem.mp-*``) until shutdown, and the ring a name until every rank
    attached."""
    executor = tp2.engine.executor
    assert executor.shm_name is None  # the ring is a memfd
    mapped = mapped_shm([os.getpid(), *executor.worker_pids])
    assert mapped and not [n for n in mapped if (Path("/dev/shm") / n).exists()]  # the communicator's: unlinked
    assert len(tp2.generate(STORY_PROMPTS[:2], SamplingParams(max_tokens=4))) == 2  # the mappings still work


def test_calls_from_two_threads_do_not_interleave(tp2):
    """A metrics read (another thread) during a step: each caller gets its own replies. Before the lock,
    both threads waited on the same pipes and one could take the other's reply."""
    executor, got, errors = tp2.engine.executor, {}, []

    def caller(tag: str, seconds: float) -> None:
        try:
            got[tag] = [executor.collective_rpc(sleep_and_echo, args=((tag, i), seconds)) for i in range(4)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=("slow", 0.3)), threading.Thread(target=caller, args=("fast", 0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for tag in ("slow", "fast"):
        assert got[tag] == [[(0, (tag, i)), (1, (tag, i))] for i in range(4)]


def _start(llm: LLM, n: int = 3) -> None:
    for i in range(n):
        llm.engine.add_request(str(i), STORY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=100,
                                                                        ignore_eos=True))
    llm.engine.step()
    llm.engine.step()


def _step_until_dead(llm: LLM) -> tuple[EngineDeadError, float]:
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return info.value, time.monotonic() - t0


@pytest.mark.isolated  # timing: a heartbeat or deadline of seconds must not meet another test's load
def test_a_stopped_rank_is_lost_within_the_heartbeat_timeout():
    """SIGSTOP of rank 1 mid-run: rank 0 waits in a collective, rank 1 beats no more; before, the driver
    waited for the 300 s execute timeout (the collective's own: 120 s)."""
    llm = LLM(tensor_parallel_size=2, executor_params={"heartbeat_timeout_s": 3}, **SMALL)
    executor = llm.engine.executor
    pids, shm = executor.worker_pids, executor.shm_name
    _start(llm)
    os.kill(pids[1], signal.SIGSTOP)
    error, seconds = _step_until_dead(llm)
    assert "worker rank 1" in str(error) and "no heartbeat" in str(error) and seconds < 3 + 3, (error, seconds)
    assert sorted(o.request_id for o in error.outputs) == ["0", "1", "2"]
    assert resources_gone(pids, [shm])  # the stopped rank was killed too


@pytest.mark.isolated  # timing: a heartbeat or deadline of seconds must not meet another test's load
def test_a_rank_hanging_in_a_step_misses_the_step_deadline():
    """A plugin that sleeps inside the forward (the process still beats): the step deadline, from the steps
    measured so far, ends it; before, a flat 300 s."""
    llm = LLM(executor_params={"min_step_deadline_s": 2}, **SMALL)
    pids, shm = llm.engine.executor.worker_pids, llm.engine.executor.shm_name
    _start(llm)
    llm.engine.executor.collective_rpc(hang_worker, args=(60.0,))
    error, seconds = _step_until_dead(llm)
    assert "no reply to 'execute_model'" in str(error) and "step deadline" in str(error), error
    assert seconds < 2 + 3, seconds
    assert resources_gone(pids, [shm])


@pytest.mark.isolated  # timing: a heartbeat or deadline of seconds must not meet another test's load
def test_a_control_call_has_a_deadline_too():
    """Before, every call but execute_model waited as long as the workers lived."""
    llm = LLM(**SMALL)
    executor = llm.engine.executor
    executor.deadlines = dataclasses.replace(executor.deadlines, rpc_timeout_s=1)  # after start-up's own calls
    pids = executor.worker_pids
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="rpc_timeout_s=1"):
        llm.engine.executor.collective_rpc(sleep_and_echo, args=("x", 60.0))
    assert time.monotonic() - t0 < 4
    assert resources_gone(pids)


def test_llm_generate_shuts_the_workers_down_when_a_step_fault_kills_the_engine(monkeypatch):
    llm = LLM(**SMALL)
    pids = llm.engine.executor.worker_pids

    def broken(*args, **kwargs):
        raise RuntimeError("scheduler bug (simulated)")

    monkeypatch.setattr(llm.engine.scheduler, "update_from_output", broken)
    with pytest.raises(EngineDeadError, match="scheduler bug"):
        llm.generate(STORY_PROMPTS[:2], SamplingParams(max_tokens=4))
    assert resources_gone(pids), "the worker outlived its dead engine"
