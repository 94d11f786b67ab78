"""``kv_connector=zmq`` under ``executor=mp tensor_parallel_size=2``: a TP=2 producer engine's ranks each serve their
own KV heads' shard at base port + rank, and a TP=2 consumer engine's rank r pulls from producer rank r (vLLM's
NixlConnector per TP rank); float32 greedy stories260K token-exact against one plain engine, every transferred
block bitwise the producer's on each rank, a TP=1 consumer of the TP=2 producer failing the request or recomputing
it per ``kv_transfer.load_failure_policy`` (a warning and, under ``fail``, the request's error naming the fix), and no zmq thread or listening port left
after ``close()``. Model-free: two ranks agree on consecutive free ports, or all refuse a base whose run is taken."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time

import pytest
import torch
import zmq
from helpers import STORIES
from kv_ranks import close_kv_connector, rank_kv_blocks

from framework import LLM, SamplingParams
from framework.config import EngineConfig
from framework.engine.kv_transfer_support import kv_transfer_problems
from plugins.kv_connectors.zmq import ZmqConnector

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

BLOCK = 4
ENGINE = dict(model=STORIES, dtype="float32", compile=False, block_size=BLOCK, num_blocks=128, max_model_len=128)
TP2 = dict(executor="mp", tensor_parallel_size=2)
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["Once upon a time there was a little girl named Lily who loved to play in the park",
           "Tom had a big red ball and a small dog"]  # pulled by the TP=2 consumer
MISMATCHED = ["Max liked to run after the big ball in the garden with his sister every day",
              "A small bird sat on the tree and sang"]  # offered to TP=1 consumers (fail, then recompute)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _with(params: dict) -> SamplingParams:
    return dataclasses.replace(GREEDY, kv_transfer_params=params)


def _released(llm: LLM, request_ids: set[str], timeout_s: float = 30.0) -> bool:
    """Step the producer until none of ``request_ids`` holds blocks any more (their pulls acknowledged)."""
    held = llm.engine.scheduler.kv_transfer.held
    deadline = time.monotonic() + timeout_s
    while request_ids & set(held) and time.monotonic() < deadline:
        llm.engine.step()
    return not request_ids & set(held)


def _no_block_held(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "a finished run still holds KV blocks"


def test_taken_at_tp2_under_mp_with_every_rank_s_port_in_range():
    def problems(**params):
        config = EngineConfig(model="m", kv_connector="zmq", kv_connector_params=params, **TP2)
        return ZmqConnector.validate(config) + kv_transfer_problems(config)

    assert problems() == [] and problems(port=65534) == []
    assert any("65535" in p and "lower port" in p for p in problems(port=65535))  # rank 1 would need 65536


def _bind_two_ranks(port: int) -> list:
    """``bind_rank_server`` on two threads standing in for two ranks, exchanging through a barrier as the TP group's
    all-gather does; each rank's server or the exception it raised."""
    from plugins.kv_connectors._zmq_wire import bind_rank_server

    slots, barrier, results = [None, None], threading.Barrier(2), [None, None]

    def rank(r: int) -> None:
        def exchange(values):
            slots[r] = list(values)
            barrier.wait()
            out = list(slots)
            barrier.wait()
            return out

        caches = [torch.zeros(2, 4, BLOCK, 1, 2)]
        try:
            results[r] = bind_rank_server(caches, 1, "127.0.0.1", port, 60.0, r, 2, exchange)
        except zmq.ZMQError as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_ranks_bind_consecutive_ports_or_all_refuse():
    servers = _bind_two_ranks(0)  # a free run, agreed between the ranks
    try:
        assert servers[1].port == servers[0].port + 1
    finally:
        for server in servers:
            server.close()
    blocker = None
    while blocker is None:  # a free base whose next port (rank 1's) this test takes
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        try:
            blocker = socket.create_server(("127.0.0.1", base + 1))
        except OSError:
            continue  # base + 1 in use already: another base
    with blocker:
        errors = _bind_two_ranks(base)
    assert all(isinstance(e, zmq.ZMQError) and f"ports {base}-{base + 1}" in str(e) for e in errors), errors


@pytest.fixture(scope="module")
def plain():
    return _tokens(LLM(**ENGINE).generate(PROMPTS + MISMATCHED, GREEDY))


@pytest.fixture(scope="module")
def producer():
    """A TP=2 producer that prefilled every prompt (``max_tokens=1``, as a P/D prefill) and handed the held blocks
    to its ranks' servers; yields ``(llm, kv_transfer_params per prompt)``."""
    # abort_timeout_s: a loaded host may take minutes to start a consumer; an unpulled hold must outlast that
    llm = LLM(**ENGINE, **TP2, kv_connector="zmq", kv_role="kv_producer", kv_connector_params={"abort_timeout_s": 600})
    engine, params = llm.engine, {}
    for i, prompt in enumerate(PROMPTS + MISMATCHED):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=1))
    while len(params) < len(PROMPTS + MISMATCHED):
        params.update({o.request_id: o.kv_transfer_params for o in engine.step() if o.finished})
    engine.step()  # the next step's metadata hands the held blocks to every rank's server
    try:
        yield llm, [params[f"p{i}"] for i in range(len(params))]
    finally:
        llm.engine.shutdown()


def test_tp2_consumer_pulls_each_rank_s_shard_exactly(plain, producer):
    producer_llm, params = producer
    assert all(p["tp_size"] == 2 and p["remote_block_ids"] for p in params)
    consumer = LLM(**ENGINE, **TP2, kv_connector="zmq", kv_role="kv_consumer")
    try:
        connector, pulls = consumer.engine.scheduler.kv_transfer.connector, []
        build = connector.build_connector_meta
        connector.build_connector_meta = lambda so: (meta := build(so), pulls.extend(meta.pulls))[0]
        assert _tokens(consumer.generate(PROMPTS, [_with(p) for p in params[:2]])) == plain[:2]
        assert consumer.engine.scheduler.kv_transfer.external_prefix_cache_hits > 0
        assert sorted(p.remote_request_id for p in pulls) == ["p0", "p1"] and all(p.local_block_ids for p in pulls)
        for pull in pulls:  # the producer ran nothing since: its blocks still hold what was sent
            sent = producer_llm.engine.executor.collective_rpc(rank_kv_blocks, args=(pull.remote_block_ids,))
            got = consumer.engine.executor.collective_rpc(rank_kv_blocks, args=(pull.local_block_ids,))
            assert not torch.equal(sent[0][0], sent[1][0]), "the two ranks' shards should differ"
            for rank in range(2):
                for layer, (want, have) in enumerate(zip(sent[rank], got[rank])):
                    assert torch.equal(want.view(torch.uint8), have.view(torch.uint8)), (
                        f"rank {rank} layer {layer}: the pulled blocks are not bitwise the producer rank's")
        _no_block_held(consumer)
        for before, after in consumer.engine.executor.collective_rpc(close_kv_connector):
            assert before and not after, f"zmq threads left in a consumer rank after close: {after}"
    finally:
        consumer.engine.shutdown()
    assert _released(producer_llm, {"p0", "p1"}), "the consumer's pulls did not free the producer's blocks"


def test_a_tp1_consumer_of_a_tp2_producer_fails_or_recomputes_per_policy(plain, producer, caplog):
    producer_llm, params = producer
    for i, policy in ((0, "fail"), (1, "recompute")):
        consumer = LLM(**ENGINE, kv_connector="zmq", kv_role="kv_consumer", kv_load_failure_policy=policy)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="plugins.kv_connectors"):
            out = consumer.generate([MISMATCHED[i]], [_with(params[2 + i])])[0]
        assert "tensor_parallel_size=2 and this engine 1" in caplog.text
        assert "the same parallel.tensor_parallel_size" in caplog.text
        if policy == "fail":
            assert out.outputs[0].finish_reason == "abort" and "load_failure_policy=fail" in out.error
            assert "the same parallel.tensor_parallel_size" in out.error, "the fix must reach the request's error"
        else:
            assert out.error is None and out.outputs[0].token_ids == plain[2 + i]
        _no_block_held(consumer)
        consumer.engine.runner.kv_connector.connector.close()
    # the TP=1 consumer's one rank released the request on both producer ranks
    assert _released(producer_llm, {"p2", "p3"}), "a mismatched consumer did not free the producer's blocks"
    # what the producer still holds is the blocks of the prompts nobody pulled yet (p0, p1 when this test runs alone)
    kv, held = producer_llm.engine.scheduler.kv, producer_llm.engine.scheduler.kv_transfer.held
    kv.check_invariants()
    assert kv.num_blocks - kv.num_free_blocks == len({b for rid in held for b in kv.get_block_ids(rid)}), sorted(held)


def test_close_stops_every_rank_s_threads_and_frees_its_port(producer):
    producer_llm, params = producer
    for before, after in producer_llm.engine.executor.collective_rpc(close_kv_connector):
        assert before and not after, f"zmq threads left in a producer rank after close: {after}"
    for rank in range(2):  # rank r served at remote_port + r: free again
        socket.create_server((params[0]["remote_host"], params[0]["remote_port"] + rank)).close()
