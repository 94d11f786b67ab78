"""The engine core in its own process (issue 49): ``AsyncLLM`` over ``MPCoreClient``s, without HTTP.

Greedy outputs equal the offline engine's; a refused request fails alone; an abort frees the request's blocks (the
core's published load returns to zero); two replicas behind a router answer every request once with the same
outputs; a core process that is killed fails the requests it held and, with no replica left, every later one;
shutdown leaves no process behind; a build the config refuses surfaces as the config error."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import pytest
from helpers import STORIES, STORY_PROMPTS, HookRecorder, resources_gone

from framework import LLM, registry
from framework.config import EngineConfig
from framework.core.faults import EngineDeadError
from framework.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.core.structured_output_params import StructuredOutputsParams
from framework.engine.async_llm import AsyncLLM
from framework.engine.core_client import MPCoreClient
from framework.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CommandEncoder,
    EngineCoreOutputs,
    OutputsEncoder,
    ReplicaStats,
    Shutdown,
)

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

pytest.importorskip("zmq")
CONFIG = EngineConfig(model=STORIES, compile=False, max_model_len=128, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.DELTA)


def test_messages_round_trip_through_msgpack():
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["\n"], logit_bias={3: -1.0}, seed=4,
                            output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    codec = CommandEncoder()
    for command in (AddRequest("r1", [1, 2, 3], params, priority=2), AddRequest("r2", "text", SamplingParams()),
                    AbortRequests(["r1", "r2"]), Shutdown()):
        assert codec.decode(codec.encode(command)) == command
    output = RequestOutput("r1", None, [1, 2], [CompletionOutput(0, "hi", [5], "stop", "\n", [{5: -0.1}])], True,
                           RequestMetrics(0.1, 0.02, [0.02], 0.3, 0.0, 2, 1, 0, 0), prompt_logprobs=[None, {2: -1.0}])
    event = EngineCoreOutputs(outputs=[output], stats=[ReplicaStats(0, num_running_reqs=1, kv_cache_usage=0.5)])
    codec_out = OutputsEncoder()
    assert codec_out.decode(codec_out.encode(event)) == event


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams = GREEDY, request_id: str | None = None) -> list[int]:
    tokens: list[int] = []
    async for out in llm.generate(prompt, params, request_id=request_id):
        tokens += out.outputs[0].token_ids
    return tokens


def _offline(prompts: list[str]) -> list[list[int]]:
    outs = LLM(model=STORIES, compile=False, max_model_len=128).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12))
    return [o.outputs[0].token_ids for o in outs]


def _front(n: int = 1, router: str = "round_robin", config: EngineConfig = CONFIG, **kwargs) -> AsyncLLM:
    clients = [MPCoreClient(config, replica_id=i, data_parallel_size=n) for i in range(n)]
    llm = AsyncLLM.from_clients(clients, router=registry.create("router", router, seed=0) if n > 1 else None,
                                **kwargs)
    for client in clients:
        client.wait_for_hello(120)
    return llm


def _wait_ready(llm: AsyncLLM, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not llm.ready:
        assert time.monotonic() < deadline, "the engine core never became ready"
        time.sleep(0.05)


def test_one_core_process_serves_like_the_offline_engine():
    prompts = STORY_PROMPTS[:4]
    want = _offline(prompts)
    observer = HookRecorder()
    with registry.registered(observer, name="test-observer"):
        llm = _front()
    pids = [c.process.pid for c in llm.clients]
    try:
        _wait_ready(llm)

        async def run():
            got = await asyncio.gather(*(_collect(llm, p) for p in prompts))
            with pytest.raises(ValueError, match="max_model_len"):  # refused alone
                await _collect(llm, [1] * 500)
            with pytest.raises(ValueError, match="already in use"):
                await asyncio.gather(_collect(llm, prompts[0], request_id="dup"),
                                     _collect(llm, prompts[1], request_id="dup"))
            long = SamplingParams(max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            async for _ in llm.generate(prompts[0], long):
                break  # leaving the stream aborts the request
            return got

        with registry.registered(observer, name="test-observer"):
            assert asyncio.run(run()) == want
        deadline = time.monotonic() + 10  # the abort's blocks come back: the core publishes an empty cache
        while llm._stats[0].num_running_reqs or llm._stats[0].kv_cache_usage:
            assert time.monotonic() < deadline, llm._stats[0]
            time.sleep(0.05)
    finally:
        llm.shutdown()
    assert resources_gone(pids)
    assert llm.summaries[0]["num_requests"] >= len(prompts)  # the core's metrics summary came back at shutdown
    assert len(observer.started) == 1 and observer.started[0]["model"] == STORIES
    assert sum(s.num_generated_tokens for s in observer.steps) >= 4 * 12 and len(observer.finished) >= 4


def test_two_core_processes_behind_a_router_answer_each_request_once():
    prompts = STORY_PROMPTS[:4] * 2
    want = _offline(prompts)
    llm = _front(2)
    pids = [c.process.pid for c in llm.clients]
    try:
        _wait_ready(llm)

        async def run():
            return await asyncio.gather(*(_collect(llm, p) for p in prompts))

        assert asyncio.run(run()) == want
        assert llm.num_routed == [4, 4]
        os.kill(pids[1], signal.SIGKILL)  # replica 1's core dies: the router stops choosing it
        deadline = time.monotonic() + 10
        while llm.replica_alive() != [True, False]:
            assert time.monotonic() < deadline, llm.replica_alive()
            time.sleep(0.05)
        assert asyncio.run(run()) == want and llm.num_routed == [12, 4]
    finally:
        llm.shutdown()
    assert resources_gone(pids)


def test_a_killed_core_fails_its_requests_and_the_front_dies():
    dead: list[BaseException] = []
    # the whole context (510 new tokens), and the kill once the first token is back: the request is still
    # running then (a fixed sleep raced a fast host, which finished a shorter request first)
    llm = _front(on_dead=dead.append, config=dataclasses.replace(CONFIG, max_model_len=512))
    pid = llm.clients[0].process.pid
    try:
        _wait_ready(llm)

        async def run():
            long = SamplingParams(max_tokens=510, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
            stream = llm.generate([1, 403], long)
            first = await asyncio.wait_for(stream.__anext__(), 20)
            assert not first.finished
            os.kill(pid, signal.SIGKILL)

            async def drain():
                return [out async for out in stream]

            with pytest.raises(EngineDeadError, match="exited with status"):
                await asyncio.wait_for(drain(), 20)
            with pytest.raises(EngineDeadError):  # later requests fail at once
                await asyncio.wait_for(_collect(llm, [1, 403]), 5)

        asyncio.run(run())
        assert len(dead) == 1 and not llm.is_running
    finally:
        llm.shutdown()
    assert resources_gone([pid])


def test_a_refused_config_surfaces_as_the_config_error():
    client = MPCoreClient(dataclasses.replace(CONFIG, scheduler="no_such_policy"))
    llm = AsyncLLM.from_clients([client])
    try:
        with pytest.raises((ValueError, TypeError), match="no_such_policy"):
            client.wait_for_hello(120)
    finally:
        llm.shutdown()
    assert resources_gone([client.process.pid])
