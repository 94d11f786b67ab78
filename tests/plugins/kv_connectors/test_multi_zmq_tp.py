"""``kv_connector=multi`` of ``[offload, zmq]`` under ``executor=mp tensor_parallel_size=2`` (vLLM's MultiConnector over
an offload tier and P/D transfer): a TP=2 producer prefills, a TP=2 ``kv_both`` consumer pulls every rank's shard
through the ``zmq`` in its list (its empty ``offload`` answers first with nothing) and stores what it computes in its
``offload`` tier; its local prefix cache dropped, a second run of the same prompts hits that tier. Both runs are
float32 greedy stories260K token-exact against one plain engine, and no block is left held on either side."""

from __future__ import annotations

import dataclasses
import time

import pytest
from helpers import STORIES

from framework import LLM, SamplingParams

ENGINE = dict(model=STORIES, dtype="float32", compile=False, block_size=4, num_blocks=128, max_model_len=128)
TP2 = dict(executor="mp", tensor_parallel_size=2)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play in the park",
           "Tom had a big red ball and a small dog", "Hi"]  # "Hi": shorter than one block


def _multi(kv_role: str) -> LLM:
    connectors = [{"name": "offload", "params": {"cpu_bytes": 1 << 20}},
                  {"name": "zmq", "params": {"abort_timeout_s": 600}}]
    return LLM(**ENGINE, **TP2, kv_connector="multi", kv_role=kv_role, kv_connector_params={"connectors": connectors})


def _tokens(outputs) -> list[list[int]]:
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [list(o.outputs[0].token_ids) for o in outputs]


def _no_block_held(llm: LLM, timeout_s: float = 30.0) -> None:
    """Step ``llm`` until its delayed frees are done (a producer waits for the pulls' acknowledgements), then check."""
    deadline = time.monotonic() + timeout_s
    while llm.engine.scheduler.kv_transfer.held and time.monotonic() < deadline:
        llm.engine.step()
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "a finished run still holds KV blocks"


@pytest.fixture(scope="module")
def plain():
    llm = LLM(**ENGINE)
    try:
        return _tokens(llm.generate(PROMPTS, GREEDY))
    finally:
        llm.engine.shutdown()


def test_multi_offload_zmq_tp2_producer_to_tp2_consumer_is_exact(plain):
    producer = _multi("kv_producer")
    try:
        prefills = producer.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1))
        params = [o.kv_transfer_params for o in prefills]
        assert all(p["tp_size"] == 2 for p in params) and params[0]["remote_block_ids"]
        consumer = _multi("kv_both")
        try:
            transfer = consumer.engine.scheduler.kv_transfer
            pulled = consumer.generate(PROMPTS, [dataclasses.replace(GREEDY, kv_transfer_params=p) for p in params])
            assert _tokens(pulled) == plain
            pulled_tokens = transfer.external_prefix_cache_hits
            assert pulled_tokens >= len(params[0]["remote_block_ids"]) * 4, "the zmq in the list pulled nothing"
            _no_block_held(consumer)
            consumer.engine.scheduler.reset_prefix_cache()  # the second run must come from the offload tier
            assert _tokens(consumer.generate(PROMPTS, GREEDY)) == plain
            assert transfer.external_prefix_cache_hits > pulled_tokens, "the offload in the list served no hit"
            _no_block_held(consumer)
        finally:
            consumer.engine.shutdown()
        _no_block_held(producer)  # every pull acknowledged on both producer ranks
    finally:
        producer.engine.shutdown()
