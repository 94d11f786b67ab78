"""A KV connector under the shadow cache (``framework/testing/shadow_cache.py``): random workloads whose prompts share
stored prefixes load blocks at admission, a random share of those loads fails, and no request that the scheduler lets
run on ever reads K/V that is not its own prefix's: a failed block (and what was computed over it) never serves a
later prefix hit, under both load-failure policies; no block leaks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from framework.core.kv_transfer import KVTransfer
from framework.core.outputs import KVConnectorMetadata, KVConnectorOutput, SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.interfaces import KVConnector, KVConnectorRole
from framework.testing.shadow_cache import ShadowCache, _fingerprints, check_step, fake_runner
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy

BS = 4


@dataclass
class _Loads(KVConnectorMetadata):
    loads: list[tuple[int, Request, int]] = field(default_factory=list)  # (block id, request, block index)


class StoreConnector(KVConnector):
    """Offers the stored full prompt blocks (a set of token prefixes) after the local hit; records the loads."""

    name = "store"

    def __init__(self, stored: set[tuple[int, ...]]) -> None:
        super().__init__(role=KVConnectorRole.SCHEDULER, block_size=BS, kv_role="kv_consumer")
        self.stored = stored
        self._loads: list[tuple[int, Request, int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = end = num_computed_tokens // BS
        while end < (request.num_prompt_tokens - 1) // BS and tuple(request.prompt_token_ids[:(end + 1) * BS]) in self.stored:
            end += 1
        return (end - first) * BS, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        first = request.num_computed_tokens // BS
        self._loads += [(block_ids[i], request, i) for i in range(first, first + num_external_tokens // BS)]

    def build_connector_meta(self, scheduler_output):
        meta, self._loads = _Loads(self._loads), []
        return meta

    def start_load_kv(self, **kwargs):
        raise AssertionError("model-free")

    def wait_for_layer_load(self, layer_idx):
        raise AssertionError("model-free")

    def save_kv_layer(self, layer_idx, kv_layer, **kwargs):
        raise AssertionError("model-free")

    def wait_for_save(self):
        raise AssertionError("model-free")


def _workload(rng: random.Random, n: int) -> tuple[list[Request], set[tuple[int, ...]]]:
    """``n`` prompts over 3 shared prefixes (whose full blocks are stored) plus random tails."""
    prefixes = [[rng.randrange(10, 99) for _ in range(rng.randint(BS, 6 * BS))] for _ in range(3)]
    stored = {tuple(p[:(i + 1) * BS]) for p in prefixes for i in range(len(p) // BS)}
    prompts = [rng.choice(prefixes) + [rng.randrange(10, 99) for _ in range(rng.randint(0, 2 * BS))] for _ in range(n)]
    return [Request(f"r{i}", p, SamplingParams(max_tokens=rng.randint(1, 6)), eos_token_ids=frozenset())
            for i, p in enumerate(prompts)], stored


def _step(sched: Scheduler, shadow: ShadowCache, rng: random.Random, fail_rate: float) -> None:
    out = sched.schedule()
    bad = set()
    for block, request, i in out.kv_connector_metadata.loads:  # the worker's loads, after the swaps
        ok = rng.random() >= fail_rate
        bad |= set() if ok else {block}
        fps = _fingerprints(request.all_token_ids, (i + 1) * BS)
        for pos in range(i * BS, (i + 1) * BS):
            shadow.slots[block * BS + pos % BS] = (0, fps[pos]) if ok else (0, -1)
    failing = {r.request_id for r in out.scheduled_requests  # it reads a block that did not arrive
               if any(b in bad for b in out.block_ids[r.request_id][0][:-(-r.num_computed_tokens // BS)])}
    for r in out.scheduled_requests:  # their forward computes over garbage: everything they write is garbage
        if r.request_id in failing:
            table = out.block_ids[r.request_id][0]
            for pos in range(r.num_computed_tokens, r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]):
                shadow.slots[shadow.slot(table, pos)] = (0, -1)
    healthy = [r for r in out.scheduled_requests if r.request_id not in failing]
    check_step(shadow, SchedulerOutput(scheduled_requests=healthy,
                                       num_scheduled_tokens={r.request_id: out.num_scheduled_tokens[r.request_id]
                                                             for r in healthy},
                                       total_num_scheduled_tokens=0, block_ids=out.block_ids))
    runner = fake_runner(out, lambda r: 7)
    runner.kv_connector_output = KVConnectorOutput(invalid_block_ids=bad)
    sched.update_from_output(out, runner)
    failures = sched.faults.take()
    assert set(failures) <= failing
    sched.abort_requests(list(failures), failures)  # what the engine does after the update
    sched.kv.check_invariants()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("threshold", [0, 2])  # 2: a recompute takes several steps while others are admitted
def test_failed_loads_never_serve_a_prefix_hit(policy, seed, threshold):
    rng = random.Random(seed)
    requests, stored = _workload(rng, 12)
    kv = PagedKVAllocator(40, BS, enable_prefix_caching=True)
    sched = Scheduler(FCFSPolicy(), kv, StopChecker(tokenizer=None), max_num_seqs=4, max_num_batched_tokens=24,
                      max_model_len=80, long_prefill_token_threshold=threshold,
                      kv_transfer=KVTransfer(StoreConnector(stored), policy))
    shadow = ShadowCache(BS)
    pending = list(requests)
    for _ in range(400):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        _step(sched, shadow, rng, fail_rate=0.25)
    assert not pending and not sched.has_unfinished_requests()
    assert sched.kv_transfer.external_prefix_cache_hits > 0
    assert kv.num_free_blocks == kv.num_blocks


class AsyncStoreConnector(StoreConnector):
    """:class:`StoreConnector` whose loads are all asynchronous; a finished request's blocks are freed at once or
    after a send (``delay_free``) at random; so is an abort while parked (cancelled, or held until the load lands)."""

    name = "async_store"

    def __init__(self, stored: set[tuple[int, ...]], rng: random.Random) -> None:
        super().__init__(stored)
        self.rng = rng

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return super().get_num_new_matched_tokens(request, num_computed_tokens)[0], True

    def request_finished(self, request, block_ids):
        return self.rng.random() < 0.5, None


def _async_step(sched: Scheduler, shadow: ShadowCache, rng: random.Random, inflight: dict, cancelled: set) -> None:
    """One step of a simulated worker whose loads land 0-3 steps after they start; a load writes its blocks only
    when it lands (garbage before: a prefix hit on them would read it), unless its request was cancelled; delayed
    sends finish at random."""
    out = sched.schedule()
    for block, request, i in out.kv_connector_metadata.loads:
        inflight.setdefault(request.request_id, [rng.randint(0, 3), []])[1].append((block, request, i))
        for pos in range(i * BS, (i + 1) * BS):
            shadow.slots[block * BS + pos % BS] = (0, -1)
    check_step(shadow, out)
    recving, bad = set(), set()
    for rid in list(inflight):
        if rid in cancelled:  # the scheduler freed its blocks: the worker drops the load, writes nothing
            del inflight[rid]
            continue
        inflight[rid][0] -= 1
        if inflight[rid][0] >= 0:
            continue
        for block, request, i in inflight.pop(rid)[1]:
            ok = rng.random() >= 0.2
            bad |= set() if ok else {block}
            fps = _fingerprints(request.all_token_ids, (i + 1) * BS)
            for pos in range(i * BS, (i + 1) * BS):
                shadow.slots[block * BS + pos % BS] = (0, fps[pos]) if ok else (0, -1)
        recving.add(rid)
    sending = {rid for rid in sched.kv_transfer.held if rid not in inflight and rng.random() < 0.5}
    runner = fake_runner(out, lambda r: 7)
    runner.kv_connector_output = KVConnectorOutput(invalid_block_ids=bad, finished_recving=recving or None,
                                                   finished_sending=sending or None)
    sched.update_from_output(out, runner)
    failures = sched.faults.take()
    sched.abort_requests(list(failures), failures)
    parked = list(sched.kv_transfer.parked)
    if parked and rng.random() < 0.1:  # the caller aborts a parked request
        rid = rng.choice(parked)
        sched.abort_requests([rid])
        if rid not in sched.kv_transfer.held:
            cancelled.add(rid)
    sched.kv.check_invariants()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("seed", range(8))
def test_asynchronous_loads_never_serve_a_prefix_hit_before_they_land(policy, seed):
    rng = random.Random(seed)
    requests, stored = _workload(rng, 12)
    kv = PagedKVAllocator(40, BS, enable_prefix_caching=True)
    sched = Scheduler(FCFSPolicy(), kv, StopChecker(tokenizer=None), max_num_seqs=4, max_num_batched_tokens=24,
                      max_model_len=80, kv_transfer=KVTransfer(AsyncStoreConnector(stored, rng), policy))
    shadow, inflight, cancelled = ShadowCache(BS), {}, set()
    pending = list(requests)
    for _ in range(600):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not pending and not sched.has_unfinished_requests():
            break
        _async_step(sched, shadow, rng, inflight, cancelled)
    assert not pending and not sched.has_unfinished_requests() and not sched.kv_transfers_in_flight
    assert sched.kv_transfer.external_prefix_cache_hits > 0
    assert kv.num_free_blocks == kv.num_blocks
