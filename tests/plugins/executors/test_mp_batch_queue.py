"""``executor=mp`` with ``pipeline_parallel_size=2`` and two batches in flight (vLLM's batch queue): stage 0 runs
batch k+1 while stage 1 runs batch k. More requests of different lengths than ``max_num_seqs`` so batches really
overlap; greedy float32 tokens equal transformers'; an abort while in flight; the last stage (the driver rank) killed
with a batch in flight fails every request and leaves no process or ``/dev/shm`` segment. TP=2 x PP=2 and the stages
as Ray actors, each with two batches in flight: ``test_mp_pipeline.py``."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import STORIES, STORY_PROMPTS, hf_greedy

from framework import LLM, SamplingParams
from framework.interfaces import EngineDeadError
from framework.testing.leftovers import shm_snapshot, wait_for_nothing_left

MAX_TOKENS = 12
ENGINE = dict(model=STORIES, attention="torch", executor="mp", pipeline_parallel_size=2, max_num_seqs=2,
              block_size=8, num_blocks=64, max_num_batched_tokens=32, long_prefill_token_threshold=8,
              kv_cache_memory_bytes=1 << 50)


@pytest.fixture(scope="module")
def pp2():
    llm = LLM(**ENGINE)
    yield llm
    llm.engine.shutdown()


def _ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok(p).input_ids for p in prompts]


def test_two_batches_overlap_with_greedy_parity(pp2):
    engine = pp2.engine
    assert engine.executor.max_concurrent_batches == 2 and engine.batches.max_batches == 2
    ids = _ids(pp2, STORY_PROMPTS[:6])
    outs = pp2.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, MAX_TOKENS)
    assert engine.batches.peak_in_flight == 2, "stage 0 never ran a batch while stage 1 ran the one before"
    assert not engine.scheduler.in_flight and engine.executor.num_steps_in_flight == 0


def test_abort_while_in_flight(pp2):
    engine = pp2.engine
    ids = _ids(pp2, STORY_PROMPTS[:4])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(ids):
        engine.add_request(f"a{i}", prompt, params)
    for _ in range(4):
        engine.step()
    victim = sorted(engine.scheduler.in_flight)[0]
    (aborted,) = engine.abort_request(victim)
    assert aborted.outputs[0].finish_reason == "abort"
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    expected = hf_greedy(STORIES, ids, MAX_TOKENS)
    assert victim not in finals
    for i in range(4):
        if f"a{i}" != victim:
            assert finals[f"a{i}"].outputs[0].token_ids == expected[i]
    kv = engine.kv_allocator
    assert kv.num_free_blocks == kv.num_blocks and engine.executor.num_steps_in_flight == 0


def test_last_stage_killed_with_a_batch_in_flight_fails_cleanly():
    shm_before = shm_snapshot()
    llm = LLM(**ENGINE)
    engine = llm.engine
    pids = engine.executor.worker_pids
    for i, prompt in enumerate(STORY_PROMPTS[:4]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.batches) == 1
    os.kill(pids[1], signal.SIGKILL)  # the driver rank, with a batch in flight
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1") as info:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 10
    assert sorted(o.request_id for o in info.value.outputs) == ["0", "1", "2", "3"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in info.value.outputs)
    assert len(engine.batches) == 0 and engine.executor.num_steps_in_flight == 0
    assert wait_for_nothing_left(shm_before, pids) == ([], []), "a stage process or a segment outlived the failure"
