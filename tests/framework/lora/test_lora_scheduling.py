"""Multi-LoRA scheduling and prefix-cache keys, model-free: the scheduler's ``max_loras`` rule (vLLM's: a waiting
request whose adapter would exceed it is skipped this step) and the paged allocator's adapter-salted block hashes."""

from __future__ import annotations

from framework.core.lora_request import LoRARequest
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy


def _lora(i: int | None) -> LoRARequest | None:
    return None if i is None else LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def _scheduler(max_loras: int, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(FCFSPolicy(), PagedKVAllocator(64, 4, True), StopChecker(tokenizer=None),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=256, max_loras=max_loras)


def _request(rid: str, lora: int | None, tokens: list[int] | None = None) -> Request:
    return Request(rid, tokens or [10 + len(rid), 11, 12, 13, 14], SamplingParams(max_tokens=2),
                   eos_token_ids=frozenset(), lora_request=_lora(lora))


def test_a_step_holds_at_most_max_loras_adapters_and_skips_only_the_overflowing_request():
    sched = _scheduler(max_loras=2)
    for rid, lora in [("r1", 1), ("r2", 2), ("r3", 3), ("r4", None), ("r5", 1)]:
        sched.add_request(_request(rid, lora))
    out = sched.schedule()
    scheduled = [r.request_id for r in out.scheduled_requests]
    assert scheduled == ["r1", "r2", "r4", "r5"]  # r3's adapter would be the third; the ones behind it still go
    assert [r.request_id for r in sched.waiting] == ["r3"]
    assert len({r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request}) == 2


def test_the_skipped_adapter_runs_once_a_slot_frees():
    sched = _scheduler(max_loras=1)
    sched.add_request(_request("r1", 1))
    sched.add_request(_request("r2", 2))
    assert [r.request_id for r in sched.schedule().scheduled_requests] == ["r1"]
    sched.abort_requests(["r1"])
    assert [r.request_id for r in sched.schedule().scheduled_requests] == ["r2"]


def test_without_lora_the_limit_does_not_apply():
    sched = _scheduler(max_loras=0)
    for i in range(4):
        sched.add_request(_request(f"r{i}", i + 1))
    assert len(sched.schedule().scheduled_requests) == 4


def test_one_prompt_under_two_adapters_shares_no_cached_block():
    kv = PagedKVAllocator(64, 4, True)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    first = _request("base", None, prompt)
    assert kv.allocate_slots(first, len(prompt)) is not None
    first.num_computed_tokens = len(prompt)
    kv.free(first)  # its blocks stay in the prefix cache
    for lora, expected_hit in [(None, 12), (1, 0), (2, 0)]:
        request = _request(f"q{lora}", lora, prompt)
        assert kv.get_computed_blocks(request)[1] == expected_hit
        assert kv.allocate_slots(request, len(prompt), kv.get_computed_blocks(request)[0]) is not None
        request.num_computed_tokens = len(prompt)
    again = _request("again", 1, prompt)
    assert kv.get_computed_blocks(again)[1] == 12  # the same adapter does share
