"""``AsyncLLM``: concurrent streams equal offline greedy results, early exit aborts, rejections,
joins between steps, shutdown aborts in-flight requests. Bounded: every wait has a timeout."""

from __future__ import annotations

import asyncio

from helpers import assert_all_blocks_free

from framework.core.sampling_params import RequestOutputKind, SamplingParams
from framework.engine.async_llm import AsyncLLM

PROMPTS = [[1, 403, 407, 261], [1, 9, 10], [1, 300, 301, 302, 303], [1, 42]]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


async def _collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str | None]:
    tokens, text, reason = [], "", None
    async for out in llm.generate(prompt, params):
        tokens += out.outputs[0].token_ids
        text += out.outputs[0].text
        reason = out.outputs[0].finish_reason
    return tokens, text, reason


def test_concurrent_streams_equal_offline(make_llm) -> None:
    llm = make_llm()
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine = AsyncLLM(llm.engine)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*[_collect(engine, p, _greedy(12)) for p in PROMPTS]), 120)

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    for (tokens, text, reason), want in zip(results, offline):
        assert tokens == want.outputs[0].token_ids and text == want.outputs[0].text and reason == "length"


def test_early_exit_aborts_and_others_finish(make_llm) -> None:
    llm = make_llm()
    engine = AsyncLLM(llm.engine)

    async def quitter():
        n = 0
        async for _ in engine.generate(PROMPTS[0], _greedy(200)):
            n += 1
            if n == 2:
                break
        return n

    async def main():
        return await asyncio.wait_for(asyncio.gather(quitter(), _collect(engine, PROMPTS[1], _greedy(30))), 120)

    try:
        n, (tokens, _, reason) = asyncio.run(main())
        assert n == 2 and len(tokens) == 30 and reason == "length"
        # the abort is applied at the next step boundary; then nothing is left in the engine
        asyncio.run(asyncio.wait_for(_collect(engine, PROMPTS[2], _greedy(2)), 60))
    finally:
        engine.shutdown()
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm.engine)


def test_rejection_raises_and_engine_stays_up(make_llm) -> None:
    engine = AsyncLLM(make_llm(max_model_len=32).engine)

    async def main():
        try:
            await _collect(engine, list(range(1, 60)), _greedy(4))
        except ValueError as exc:
            assert "max_model_len is 32" in str(exc)
        else:
            raise AssertionError("a too-long prompt must be rejected")
        return await _collect(engine, PROMPTS[1], _greedy(4))

    try:
        tokens, _, reason = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert len(tokens) == 4 and reason == "length"


def test_join_between_steps_and_shutdown_aborts_in_flight(make_llm) -> None:
    engine = AsyncLLM(make_llm().engine)
    seen: dict[str, str | None] = {}

    async def long_one(name: str, prompt: list[int], started: asyncio.Event | None = None):
        async for out in engine.generate(prompt, _greedy(10_000) if name == "long" else _greedy(5)):
            if started is not None:
                started.set()
            seen[name] = out.outputs[0].finish_reason

    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(long_one("long", PROMPTS[0], started))
        await asyncio.wait_for(started.wait(), 60)
        await asyncio.wait_for(long_one("joined", PROMPTS[1]), 60)  # joins while "long" runs
        assert not task.done()
        await asyncio.to_thread(engine.shutdown)
        await asyncio.wait_for(task, 60)

    asyncio.run(main())
    assert seen == {"joined": "length", "long": "abort"}
    assert not engine.is_running
