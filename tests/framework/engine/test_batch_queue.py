"""The engine's batch queue (vLLM V1's ``step_with_batch_queue``) in one process: an in-process executor that
holds two batches in flight (each runs only when its output is asked for, in order) drives the real engine,
scheduler and model. Greedy float32 tokens equal transformers' with more requests than ``max_num_seqs``, so two
batches really overlap; abort while in flight, an id reused while its old batch runs, and a worker lost with two
batches in flight."""

from __future__ import annotations

import pytest
from helpers import STORIES, STORY_PROMPTS, hf_greedy

from framework import LLM, EngineConfig, SamplingParams, hookimpl, registry
from framework.interfaces import EngineDeadError
from plugins.executors.uniproc import UniProcExecutor

MAX_TOKENS = 12
ENGINE = dict(model=STORIES, attention="torch", grammar="none", max_num_seqs=2, block_size=8, num_blocks=64,
              max_num_batched_tokens=32, long_prefill_token_threshold=8)


class DeferredExecutor(UniProcExecutor):
    """``uniproc`` with two batches in flight: a step's message is built when it is sent, its forward runs when
    its output is collected (oldest first), as a second pipeline stage would return it later."""

    name = "deferred2"

    def __init__(self, config: EngineConfig, die_at_step: int = -1, **params) -> None:
        self.die_at_step, self.num_collected = die_at_step, 0
        super().__init__(config, **params)

    @property
    def max_concurrent_batches(self) -> int:
        return 2

    def _send_step(self, message, scheduler_output):
        def collect():
            self.num_collected += 1
            if self.num_collected == self.die_at_step:
                raise self._fail(EngineDeadError("worker rank 0 vanished (simulated)"))
            return self.collective_rpc("execute_model", args=(message,), unique_reply_rank=0)[0]

        return collect


class _Plugin:
    @hookimpl
    def register_executors(self, register):
        register("deferred2", DeferredExecutor)


@pytest.fixture
def deferred():
    with registry.registered(_Plugin()):
        yield


def _ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(p).input_ids for p in prompts]


def test_two_batches_in_flight_keep_greedy_parity(deferred):
    llm = LLM(executor="deferred2", **ENGINE)
    ids = _ids(llm, STORY_PROMPTS[:6])  # 6 requests of different lengths, 2 per batch
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    expected = hf_greedy(STORIES, ids, MAX_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == expected
    batches = llm.engine.batches
    assert batches.max_batches == 2 and batches.peak_in_flight == 2, "the batches never overlapped"
    assert not llm.engine.scheduler.in_flight and len(batches) == 0


def _run(engine, finals: dict) -> None:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out


def test_abort_while_in_flight_and_reuse_the_id(deferred):
    llm = LLM(executor="deferred2", **ENGINE)
    engine = llm.engine
    ids = _ids(llm, STORY_PROMPTS[:4])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(ids):
        engine.add_request(str(i), prompt, params)
    finals: dict = {}
    for _ in range(4):  # a step leaves the batch it just sent in flight
        for out in engine.step():
            assert not out.finished
    assert len(engine.batches) == 1 and engine.scheduler.in_flight
    victim = sorted(engine.scheduler.in_flight)[0]
    (aborted,) = engine.abort_request(victim)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    reused = _ids(llm, [STORY_PROMPTS[5]])[0]
    engine.add_request(victim, reused, params)  # its old batch is still in flight: the new one waits for it
    _run(engine, finals)
    expected = hf_greedy(STORIES, ids + [reused], MAX_TOKENS)
    for i in range(4):
        want = expected[4] if str(i) == victim else expected[i]
        assert finals[str(i)].outputs[0].token_ids == want, f"request {i} lost or duplicated tokens"
    assert not engine.scheduler.in_flight and engine.kv_allocator.num_free_blocks == engine.kv_allocator.num_blocks


def test_worker_lost_with_two_batches_in_flight_fails_every_request(deferred):
    llm = LLM(executor="deferred2", executor_params={"die_at_step": 3}, **ENGINE)
    engine = llm.engine
    for i, prompt in enumerate(_ids(llm, STORY_PROMPTS[:4])):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    with pytest.raises(EngineDeadError, match="vanished") as info:
        _run(engine, {})
    assert sorted(o.request_id for o in info.value.outputs) == ["0", "1", "2", "3"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in info.value.outputs)
    assert len(engine.batches) == 0


def test_one_batch_at_a_time_by_default():
    llm = LLM(executor="uniproc", **ENGINE)
    ids = _ids(llm, STORY_PROMPTS[:3])
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=6))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 6)
    assert llm.engine.batches.max_batches == 1 and llm.engine.batches.peak_in_flight == 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_batch_in_flight_keeps_parity(deferred, mode):
    """A pool too small for every request: requests not in flight are preempted (never one in flight), sometimes
    in a step that schedules nothing else; the workers still learn of it (their block tables are re-sent)."""
    llm = LLM(executor="deferred2", **{**ENGINE, "num_blocks": 12, "max_model_len": 96, "max_num_seqs": 3, "preemption_mode": mode,
                                       "swap_space_bytes": 1 << 22})
    ids = _ids(llm, STORY_PROMPTS[:5])  # each fits max_model_len with its 24 tokens
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 24)
    assert llm.engine.metrics.num_preemptions > 0 and llm.engine.batches.peak_in_flight == 2


def test_a_batch_that_only_preempts_reaches_the_workers(deferred):
    """Two requests that each need the whole pool (3 blocks of 4 tokens), one per batch: with the other in flight,
    a request that needs a block preempts itself in a batch that schedules nothing; that batch still goes to the
    workers, so the request's recomputed block table replaces the one they hold."""
    llm = LLM(executor="deferred2", **{**ENGINE, "block_size": 4, "num_blocks": 3, "max_model_len": 12,
                                       "max_num_seqs": 1, "preemption_mode": "recompute",
                                       "enable_prefix_caching": False})
    scheduler, only_preempted = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        if out.is_empty and out.preempted_req_ids:
            only_preempted.append(out.preempted_req_ids)
        return out

    scheduler.schedule = recording_schedule
    ids = [p[:4] for p in _ids(llm, STORY_PROMPTS[2:4])]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=8))
    assert only_preempted, "no batch only preempted: the test lost its subject"
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 8)
