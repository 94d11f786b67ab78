"""KV connector contract (``framework.interfaces.KVConnector``), model-free, for connectors that store prompt
blocks by content (a producer engine saves, a consumer engine loads): a producer's scheduler and worker sides
save the full prompt blocks of a request; a consumer's scheduler side then offers them (side-effect free, whole
blocks, never the block of the last prompt token), and its worker side loads them bitwise into other block ids of
another cache; a producer-only side offers nothing; nothing fails to load; blocks are freed at once. A connector
that is its own store (``own_store=True``: ``offload``'s tiers live with its worker side) runs as one ``kv_both``
engine instead: it saves, its scheduler side learns the store's contents from the step's report
(``update_connector_output`` with ``get_kv_connector_kv_cache_events``), then offers and loads the blocks into other
block ids of the same cache. A load the scheduler side answers asynchronously (``load_async``, vLLM's
``WAITING_FOR_REMOTE_KVS``) runs in steps that schedule nothing until ``get_finished`` reports it (within
``async_steps`` steps). With ``tp_size > 1`` every engine has one worker side per tensor-parallel rank (each
told its ``KVShard``, each over caches of its own values), their reports merged as ``executor=mp`` merges them:
each rank must load its own shard back. Random K/V, a real attention backend's layout and ``copy_blocks``; no model
runs."""

from __future__ import annotations

import pickle
import random
import time
from typing import Any

import torch

from framework.core.outputs import KVConnectorOutput, SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.core.sampling_params import SamplingParams
from framework.executor.kv_output_aggregator import KVOutputAggregator
from framework.interfaces import AttentionBackend, KVConnector, KVConnectorRole
from framework.interfaces.kv_connector import KVShard


def _caches(backend: AttentionBackend, num_layers: int, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Per-layer caches of random values in the backend's layout and dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = backend.get_kv_cache_shape(num_blocks)
    return [torch.randn(shape, generator=gen).to(backend.cache_dtype) for _ in range(num_layers)]


class _Engine:
    """One engine of the kit: a scheduler side and ``tp_size`` worker sides (rank ``r`` told ``KVShard(r, tp_size)``),
    each over its own per-layer caches of random values (another seed per rank, so a store that mixes the ranks'
    shards is caught); each step's metadata reaches every rank through a pickle round trip (as the step message
    does under ``executor=mp``) and their reports are merged as the executor merges them (``KVOutputAggregator``)."""

    def __init__(self, cls: type[KVConnector], kv_role: str, backend: AttentionBackend, params: dict[str, Any],
                 num_layers: int, seed: int, tp_size: int) -> None:
        self.sched = cls(role=KVConnectorRole.SCHEDULER, block_size=backend.block_size, kv_role=kv_role, **params)
        self.sched.kv_shard = KVShard(0, tp_size)
        self.workers = []
        self.caches = [_caches(backend, num_layers, 16, seed + 1000 * rank) for rank in range(tp_size)]
        for rank in range(tp_size):
            worker = cls(role=KVConnectorRole.WORKER, block_size=backend.block_size, kv_role=kv_role, **params)
            worker.kv_shard = KVShard(rank, tp_size)
            worker.register_kv_caches(self.caches[rank], backend)
            self.workers.append(worker)
        self.aggregator = KVOutputAggregator(tp_size)

    def step(self, so: SchedulerOutput, recving: set[str] | None = None, sending: set[str] | None = None) -> set[int]:
        """One step: the scheduler side's metadata, every rank's loads and saves; the blocks that failed to load.
        ``recving`` / ``sending``: collect the loads / sends reported done by every rank (None: none may be)."""
        meta = self.sched.build_connector_meta(so)
        try:
            wire = pickle.dumps(meta)
        except Exception as exc:  # noqa: BLE001 - any pickling failure breaks the step message
            raise AssertionError(f"the connector metadata cannot travel to worker processes: {exc}") from exc
        reports = []
        for worker, caches in zip(self.workers, self.caches):
            worker.bind_connector_metadata(pickle.loads(wire))
            worker.start_load_kv()
            for layer_idx in range(len(caches)):
                worker.wait_for_layer_load(layer_idx)
            for layer_idx, kv_layer in enumerate(caches):
                worker.save_kv_layer(layer_idx, kv_layer)
            worker.wait_for_save()
            sent, done = worker.get_finished(set())
            reports.append(KVConnectorOutput(finished_sending=sent, finished_recving=done,
                                             invalid_block_ids=worker.get_block_ids_with_load_errors(),
                                             kv_cache_events=worker.get_kv_connector_kv_cache_events()))
            worker.clear_connector_metadata()
        out = self.aggregator.aggregate(reports)
        assert sending is not None or not out.finished_sending, "no request finished: nothing may finish sending"
        if sending is not None:
            sending |= out.finished_sending or set()
        assert recving is not None or not out.finished_recving, "a synchronous step finished a transfer"
        if recving is not None:
            recving |= out.finished_recving or set()
        self.sched.update_connector_output(out)
        return out.invalid_block_ids


def _block(cache: torch.Tensor, block: int, backend: AttentionBackend) -> torch.Tensor:
    """A copy of block ``block`` of one layer's ``cache``."""
    out = torch.empty(backend.get_kv_cache_shape(1), dtype=backend.cache_dtype)
    backend.copy_blocks([cache], [block], [out], [0])
    return out


def check_kv_connector(cls: type[KVConnector], backend: AttentionBackend, num_layers: int = 2, seed: int = 0,
                       own_store: bool = False, async_steps: int = 200, transfer_params: bool = False,
                       tp_size: int = 1, **params: Any) -> None:
    """Run ``cls`` (built with ``params``, e.g. ``path=`` a fresh folder) through a producer engine and a consumer
    engine sharing its store, or (``own_store``) through one ``kv_both`` engine that is its own store; with
    ``tp_size > 1`` each engine has one worker side per tensor-parallel rank, each over its own shard.

    Args:
        backend: an attention backend instance (its ``block_size``, cache shape, dtype and ``copy_blocks``).
        num_layers: decoder layers of the fake caches.
        own_store: the store lives in the connector instance (not shared between engines): check one engine.
        async_steps: steps (5 ms apart) an asynchronous load may take before it is reported done.
        transfer_params: a P/D connector (``zmq``): the producer's ``request_finished`` keeps the blocks
            (``delay_free``) and names them in ``kv_transfer_params``, which the consumer's request carries
            (vLLM's NixlConnector flow); the producer's worker side must report the send done once the consumer
            loaded them.
        tp_size: worker sides per engine (``executor=mp tensor_parallel_size``): rank ``r``'s instance gets
            ``kv_shard = KVShard(r, tp_size)`` and caches of other values than the other ranks'; every rank must load
            bitwise its own shard (a store keyed without the shard is caught), and its metadata must pickle.

    Raises:
        AssertionError: naming the broken part of the contract.
    """
    bs, rng = backend.block_size, random.Random(seed)
    prompt = [rng.randrange(3, 1000) for _ in range(5 * bs)]  # 5 full blocks: the last prompt token ends block 4
    producer = _Engine(cls, "kv_both" if own_store else "kv_producer", backend, params, num_layers, seed, tp_size)
    consumer = producer if own_store else _Engine(cls, "kv_consumer", backend, params, num_layers, seed + 1, tp_size)
    producer_sched, consumer_sched = producer.sched, consumer.sched

    request = Request("producer-0", list(prompt), SamplingParams(max_tokens=1))
    assert producer_sched.get_num_new_matched_tokens(request, 0)[0] == 0, (
        "an empty store (or a kv_producer) must not offer tokens")
    src_table = list(range(5))
    so = SchedulerOutput(scheduled_requests=[request], num_scheduled_tokens={request.request_id: len(prompt)},
                         total_num_scheduled_tokens=len(prompt), block_ids={request.request_id: (src_table,)})
    producer_sched.update_state_after_alloc(request, src_table, 0)
    assert not producer.step(so), "the producer reported load errors without loading"
    sending: set[str] = set()
    consumer_params = SamplingParams(max_tokens=1)
    if transfer_params:  # the prefill finished: its blocks are kept and named for the consumer
        request.status = RequestStatus.FINISHED_LENGTH
        delay_free, kv_params = producer_sched.request_finished(request, src_table)
        assert delay_free and kv_params, "a P/D producer must keep the blocks and name them in kv_transfer_params"
        consumer_params = SamplingParams(max_tokens=1, kv_transfer_params=kv_params)

    def producer_idle_step() -> None:
        if transfer_params:
            producer.step(_idle(), sending=sending)

    producer_idle_step()  # hands the kept blocks to the producer's worker side
    consumer_req = Request("consumer-0", list(prompt), consumer_params)
    offered = consumer_sched.get_num_new_matched_tokens(consumer_req, bs)
    assert offered == consumer_sched.get_num_new_matched_tokens(consumer_req, bs), "the lookup is not side-effect free"
    num_tokens, load_async = offered
    assert num_tokens % bs == 0, f"offered {num_tokens} tokens: not whole blocks of {bs}"
    assert bs + num_tokens <= len(prompt) - 1, "the block of the last prompt token must be computed, not loaded"
    assert num_tokens == 3 * bs, f"expected stored blocks 1-3 after the local hit, got {num_tokens // bs} blocks"

    dst_table = [15, 8, 9, 12, 7]  # block 0 is the local hit; blocks 1-3 load; other ids than the producer's
    want = [[[_block(src[layer], src_table[i], backend) for layer in range(num_layers)] for i in range(5)]
            for src in producer.caches]  # per rank
    consumer_req.num_computed_tokens = bs
    consumer_sched.update_state_after_alloc(consumer_req, dst_table, num_tokens)
    consumer_req.num_computed_tokens += num_tokens
    if load_async:  # parked: steps that schedule nothing until the worker side reports the load done
        recving: set[str] = set()
        for _ in range(async_steps):
            producer_idle_step()
            assert not consumer.step(_idle(), recving), "stored blocks failed to load"
            if consumer_req.request_id in recving:
                break
            time.sleep(0.005)
        assert recving == {consumer_req.request_id}, f"the asynchronous load was not reported done: {recving}"
    else:
        so = SchedulerOutput(scheduled_requests=[consumer_req], num_scheduled_tokens={consumer_req.request_id: bs},
                             total_num_scheduled_tokens=bs, block_ids={consumer_req.request_id: (dst_table,)})
        assert not consumer.step(so), "stored blocks failed to load"
    for rank, dst in enumerate(consumer.caches):
        for i in range(1, 4):
            for layer in range(num_layers):
                got = _block(dst[layer], dst_table[i], backend)
                assert torch.equal(got.view(torch.uint8), want[rank][i][layer].view(torch.uint8)), (
                    f"block {i} of layer {layer} is not bitwise the producer's after the load"
                    + (f" (rank {rank} of {tp_size}: a rank must load its own shard)" if tp_size > 1 else ""))
    assert consumer_sched.request_finished(consumer_req, dst_table)[0] is False, (
        "a synchronous connector must free blocks at once (request_finished -> delay_free False)")
    for _ in range(async_steps if transfer_params else 0):
        producer_idle_step()
        if request.request_id in sending:
            break
        time.sleep(0.005)
    assert sending == ({request.request_id} if transfer_params else set()), (
        f"the producer's send was not reported done once the consumer loaded its blocks: {sending}")


def _idle() -> SchedulerOutput:
    """A step that schedules nothing."""
    return SchedulerOutput(scheduled_requests=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0, block_ids={})
