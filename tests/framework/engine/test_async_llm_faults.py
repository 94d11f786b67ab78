"""``AsyncLLM`` under faults (issue 44): a loop that dies between ``generate``'s check and its enqueue
fails the caller instead of leaving it waiting forever; an ``EngineDeadError`` from ``add_request`` is
the engine's fault (503), not a rejection (400); a step that hangs (a lifecycle hook that never
returns) is caught by the watchdog, which logs where the loop hangs and fails every request."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from helpers import STORIES

from framework import LLM, hookimpl, registry
from framework.core.faults import EngineDeadError
from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.async_llm import AsyncLLM
from framework.engine.core_messages import AddRequest

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def _first(llm: AsyncLLM) -> None:
    async for _ in llm.generate([1, 403, 407], PARAMS):
        pass


def test_loop_dying_between_check_and_enqueue_fails_the_caller(make_llm, monkeypatch):
    llm = make_llm(attention="torch")
    engine = AsyncLLM(llm.engine)
    client = engine.clients[0]
    send = client.send

    def racing_send(command):
        if isinstance(command, AddRequest):  # generate registered the request: now the core dies (idle check)...
            def lost():
                raise EngineDeadError("worker lost (simulated)")

            monkeypatch.setattr(llm.engine, "check_health", lost)
            time.sleep(1.5)  # ... before the command is queued (the idle loop re-checks every 0.5 s)
        send(command)

    monkeypatch.setattr(client, "send", racing_send)
    try:
        with pytest.raises(EngineDeadError, match="worker lost"):
            asyncio.run(asyncio.wait_for(_first(engine), 20))  # before the fix: waits forever
    finally:
        engine.shutdown()


def test_engine_dead_error_from_add_request_is_not_a_rejection(make_llm):
    """``add_request`` of an engine whose executor died raises ``EngineDeadError``: the caller gets it as
    such (the server answers 503 ``engine_dead``), not as the ``ValueError`` of a bad request (400)."""
    from framework.entrypoints.server.app import _engine_error

    llm = make_llm(attention="torch")
    llm.engine.executor.dead = EngineDeadError("worker rank 1 exited with code -9 (simulated)")
    engine = AsyncLLM(llm.engine)
    try:
        with pytest.raises(EngineDeadError, match="exited with code -9") as info:
            asyncio.run(asyncio.wait_for(_first(engine), 20))
    finally:
        engine.shutdown()
    assert _engine_error(info.value).status == 503


class _HangingObserver:
    """A lifecycle hook that never returns (here: for ``seconds``) on its ``on_step``-th step."""

    def __init__(self, seconds: float, on_step: int = 2) -> None:
        self.seconds, self.on_step, self.steps = seconds, on_step, 0

    @hookimpl
    def on_step_end(self, stats):
        self.steps += 1
        if self.steps == self.on_step:
            time.sleep(self.seconds)


def test_watchdog_fails_every_request_when_a_hook_hangs(caplog):
    dead: list[BaseException] = []
    with registry.registered(_HangingObserver(seconds=6.0), name="hanging-observer"):
        llm = LLM(model=STORIES, attention="torch", watchdog_timeout_s=1.5)
        engine = AsyncLLM(llm.engine, on_dead=dead.append)
        t0 = time.monotonic()
        try:
            with caplog.at_level(logging.ERROR, logger="framework.engine"), \
                    pytest.raises(EngineDeadError, match="watchdog_timeout_s"):
                asyncio.run(asyncio.wait_for(_first(engine), 20))
            detected_s = time.monotonic() - t0
        finally:
            engine.shutdown(timeout_s=10)
            llm.engine.shutdown()
    assert detected_s < 5, detected_s
    assert len(dead) == 1 and isinstance(dead[0], TimeoutError)
    hung = [r.getMessage() for r in caplog.records if "hung" in r.getMessage()]
    assert hung and "on_step_end" in hung[0] and "time.sleep" in hung[0]  # where it hangs, named
    with pytest.raises(EngineDeadError):  # later requests fail at once
        asyncio.run(asyncio.wait_for(_first(engine), 5))


def test_offline_watchdog_names_the_hung_hook(caplog):
    """``LLM.generate``: a step past ``engine.watchdog_timeout_s`` is logged with the stepping thread's stack
    (the call then goes on: here the hook returns after 4 s)."""
    with registry.registered(_HangingObserver(seconds=4.0), name="hanging-observer"):
        llm = LLM(model=STORIES, attention="torch", watchdog_timeout_s=1.5)
        with caplog.at_level(logging.ERROR, logger="framework.entrypoints.llm"):
            outs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(outs[0].outputs[0].token_ids) == 4
    (hung,) = [r.getMessage() for r in caplog.records if "hung" in r.getMessage()]
    assert "on_step_end" in hung and "time.sleep" in hung
