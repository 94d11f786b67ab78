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
``async_steps`` steps). Random K/V, a real attention backend's layout and ``copy_blocks``; no model runs."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from framework.core.outputs import KVConnectorOutput, SchedulerOutput
from framework.core.request import Request, RequestStatus
from framework.core.sampling_params import SamplingParams
from framework.interfaces import AttentionBackend, KVConnector, KVConnectorRole


def _pair(cls: type[KVConnector], kv_role: str, block_size: int, params: dict[str, Any]
          ) -> tuple[KVConnector, KVConnector]:
    """A scheduler-side and a worker-side instance of ``cls`` for one engine of ``kv_role``."""
    return (cls(role=KVConnectorRole.SCHEDULER, block_size=block_size, kv_role=kv_role, **params),
            cls(role=KVConnectorRole.WORKER, block_size=block_size, kv_role=kv_role, **params))


def _caches(backend: AttentionBackend, num_layers: int, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Per-layer caches of random values in the backend's layout and dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = backend.get_kv_cache_shape(num_blocks)
    return [torch.randn(shape, generator=gen).to(backend.cache_dtype) for _ in range(num_layers)]


def _step(sched: KVConnector, worker: KVConnector, so: SchedulerOutput, caches: list[torch.Tensor],
          recving: set[str] | None = None, sending: set[str] | None = None) -> set[int]:
    """One step: the scheduler side's metadata, the worker side's loads and saves; the blocks that failed to load.
    ``recving`` / ``sending``: collect the loads / sends reported done (None: none may be)."""
    worker.bind_connector_metadata(sched.build_connector_meta(so))
    worker.start_load_kv()
    for layer_idx in range(len(caches)):
        worker.wait_for_layer_load(layer_idx)
    for layer_idx, kv_layer in enumerate(caches):
        worker.save_kv_layer(layer_idx, kv_layer)
    worker.wait_for_save()
    sent, done = worker.get_finished(set())
    assert sending is not None or not sent, "no request finished: nothing may finish sending"
    if sending is not None:
        sending |= sent or set()
    assert recving is not None or not done, "a synchronous step finished a transfer"
    if recving is not None:
        recving |= done or set()
    errors = worker.get_block_ids_with_load_errors()
    sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors, finished_recving=done, finished_sending=sent,
                                                    kv_cache_events=worker.get_kv_connector_kv_cache_events()))
    worker.clear_connector_metadata()
    return errors


def _block(cache: torch.Tensor, block: int, backend: AttentionBackend) -> torch.Tensor:
    """A copy of block ``block`` of one layer's ``cache``."""
    out = torch.empty(backend.get_kv_cache_shape(1), dtype=backend.cache_dtype)
    backend.copy_blocks([cache], [block], [out], [0])
    return out


def check_kv_connector(cls: type[KVConnector], backend: AttentionBackend, num_layers: int = 2, seed: int = 0,
                       own_store: bool = False, async_steps: int = 200, transfer_params: bool = False,
                       **params: Any) -> None:
    """Run ``cls`` (built with ``params``, e.g. ``path=`` a fresh folder) through a producer engine and a consumer
    engine sharing its store, or (``own_store``) through one ``kv_both`` engine that is its own store.

    Args:
        backend: an attention backend instance (its ``block_size``, cache shape, dtype and ``copy_blocks``).
        num_layers: decoder layers of the fake caches.
        own_store: the store lives in the connector instance (not shared between engines): check one engine.
        async_steps: steps (5 ms apart) an asynchronous load may take before it is reported done.
        transfer_params: a P/D connector (``zmq``): the producer's ``request_finished`` keeps the blocks
            (``delay_free``) and names them in ``kv_transfer_params``, which the consumer's request carries
            (vLLM's NixlConnector flow); the producer's worker side must report the send done once the consumer
            loaded them.

    Raises:
        AssertionError: naming the broken part of the contract.
    """
    bs, rng = backend.block_size, random.Random(seed)
    prompt = [rng.randrange(3, 1000) for _ in range(5 * bs)]  # 5 full blocks: the last prompt token ends block 4
    producer_sched, producer = _pair(cls, "kv_both" if own_store else "kv_producer", bs, params)
    consumer_sched, consumer = (producer_sched, producer) if own_store else _pair(cls, "kv_consumer", bs, params)
    src = _caches(backend, num_layers, 16, seed)
    dst = src if own_store else _caches(backend, num_layers, 16, seed + 1)
    producer.register_kv_caches(src, backend)
    if not own_store:
        consumer.register_kv_caches(dst, backend)

    request = Request("producer-0", list(prompt), SamplingParams(max_tokens=1))
    assert producer_sched.get_num_new_matched_tokens(request, 0)[0] == 0, (
        "an empty store (or a kv_producer) must not offer tokens")
    src_table = list(range(5))
    so = SchedulerOutput(scheduled_requests=[request], num_scheduled_tokens={request.request_id: len(prompt)},
                         total_num_scheduled_tokens=len(prompt), block_ids={request.request_id: (src_table,)})
    producer_sched.update_state_after_alloc(request, src_table, 0)
    assert not _step(producer_sched, producer, so, src), "the producer reported load errors without loading"
    sending: set[str] = set()
    consumer_params = SamplingParams(max_tokens=1)
    if transfer_params:  # the prefill finished: its blocks are kept and named for the consumer
        request.status = RequestStatus.FINISHED_LENGTH
        delay_free, kv_params = producer_sched.request_finished(request, src_table)
        assert delay_free and kv_params, "a P/D producer must keep the blocks and name them in kv_transfer_params"
        consumer_params = SamplingParams(max_tokens=1, kv_transfer_params=kv_params)

    def producer_idle_step() -> None:
        if transfer_params:
            _step(producer_sched, producer, _idle(), src, sending=sending)

    producer_idle_step()  # hands the kept blocks to the producer's worker side
    consumer_req = Request("consumer-0", list(prompt), consumer_params)
    offered = consumer_sched.get_num_new_matched_tokens(consumer_req, bs)
    assert offered == consumer_sched.get_num_new_matched_tokens(consumer_req, bs), "the lookup is not side-effect free"
    num_tokens, load_async = offered
    assert num_tokens % bs == 0, f"offered {num_tokens} tokens: not whole blocks of {bs}"
    assert bs + num_tokens <= len(prompt) - 1, "the block of the last prompt token must be computed, not loaded"
    assert num_tokens == 3 * bs, f"expected stored blocks 1-3 after the local hit, got {num_tokens // bs} blocks"

    dst_table = [15, 8, 9, 12, 7]  # block 0 is the local hit; blocks 1-3 load; other ids than the producer's
    want = [[_block(src[layer], src_table[i], backend) for layer in range(num_layers)] for i in range(5)]
    consumer_req.num_computed_tokens = bs
    consumer_sched.update_state_after_alloc(consumer_req, dst_table, num_tokens)
    consumer_req.num_computed_tokens += num_tokens
    if load_async:  # parked: steps that schedule nothing until the worker side reports the load done
        recving: set[str] = set()
        for _ in range(async_steps):
            producer_idle_step()
            assert not _step(consumer_sched, consumer, _idle(), dst, recving), "stored blocks failed to load"
            if consumer_req.request_id in recving:
                break
            time.sleep(0.005)
        assert recving == {consumer_req.request_id}, f"the asynchronous load was not reported done: {recving}"
    else:
        so = SchedulerOutput(scheduled_requests=[consumer_req], num_scheduled_tokens={consumer_req.request_id: bs},
                             total_num_scheduled_tokens=bs, block_ids={consumer_req.request_id: (dst_table,)})
        assert not _step(consumer_sched, consumer, so, dst), "stored blocks failed to load"
    for i in range(1, 4):
        for layer in range(num_layers):
            got = _block(dst[layer], dst_table[i], backend)
            assert torch.equal(got.view(torch.uint8), want[i][layer].view(torch.uint8)), (
                f"block {i} of layer {layer} is not bitwise the producer's after the load")
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
