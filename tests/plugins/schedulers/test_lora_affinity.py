"""``scheduler=lora_affinity``: its order (aged, then the base model's and loaded adapters' requests, then the other
adapters grouped), the slot reservation of an aged request that finds no slot (the other loaded adapters' requests
pass it, one adapter drains), its starvation bound against the real ``Scheduler`` (model-free, one clock unit per
step; with aging off, the negative control starves), and an engine run on stories260K with PEFT adapters whose
greedy outputs equal ``fcfs``'s while no step holds more than ``max_loras`` adapters."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import STORIES

from framework.core.lora_request import LoRARequest
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.testing.shadow_cache import Arrival, simulate
from plugins.kv_allocators.paged import PagedKVAllocator
from plugins.schedulers.fcfs import FCFSPolicy
from plugins.schedulers.lora_affinity import LoRAAffinityPolicy, remaining_work
from servelab.testing import check_scheduler_policy


def _request(rid: str, lora: int, arrival: float, max_tokens: int = 2) -> Request:
    return Request(rid, [10 + len(rid), 11, 12, 13], SamplingParams(max_tokens=max_tokens), arrival_time=arrival,
                   eos_token_ids=frozenset(), lora_request=LoRARequest(f"a{lora}", lora, f"/a{lora}") if lora else None)


def _ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def test_contract_and_an_engine_run_under_kv_pressure_equal_to_fcfs():
    check_scheduler_policy(LoRAAffinityPolicy, model=STORIES)


def test_order_loaded_adapters_and_base_first_then_groups_by_oldest_request():
    now = [6.0]
    policy = LoRAAffinityPolicy(aging_s=100.0, clock=lambda: now[0])
    policy.observe_running([_request("run", 1, 0.0)])  # adapter 1 holds a slot
    waiting = [_request(rid, lora, t) for t, (rid, lora) in
               enumerate([("r1", 2), ("r2", 1), ("r3", 0), ("r4", 3), ("r5", 2), ("r6", 3), ("r7", 1)])]
    assert _ids(policy.sort_waiting(waiting)) == ["r2", "r3", "r7", "r1", "r5", "r4", "r6"]
    assert not any(policy.wait_for_lora_slot(r) for r in waiting) and policy.reservation is None
    policy.observe_running([])  # nothing loaded: every adapter is cold, the base model stays first
    assert _ids(policy.sort_waiting(waiting)) == ["r3", "r1", "r5", "r2", "r7", "r4", "r6"]
    now[0] = 100.5  # r1 (arrived at 0) has waited aging_s: it goes first
    assert _ids(policy.sort_waiting(waiting))[:2] == ["r1", "r3"]
    with pytest.raises(ValueError, match="aging_s"):
        LoRAAffinityPolicy(aging_s=0)


def test_an_aged_request_without_a_slot_reserves_one_and_drains_the_adapter_that_finishes_first():
    now = [50.0]
    policy = LoRAAffinityPolicy(aging_s=10.0, clock=lambda: now[0])
    long1, short2 = _request("long1", 1, 0.0, max_tokens=20), _request("short2", 2, 0.0, max_tokens=2)
    policy.observe_running([long1, short2])  # both slots held (max_loras=2); adapter 2 finishes first
    waiting = [_request(rid, lora, t) for rid, lora, t in
               [("aged3", 3, 1.0), ("hot1", 1, 45.0), ("hot2", 2, 46.0), ("base", 0, 47.0), ("cold4", 4, 48.0)]]
    assert _ids(policy.sort_waiting(waiting)) == ["aged3", "hot1", "hot2", "base", "cold4"]
    assert not policy.wait_for_lora_slot(waiting[1])  # young: vLLM's skip
    assert policy.wait_for_lora_slot(waiting[0])  # aged, no slot: it reserves one and holds admission this step
    assert policy.reservation.draining == 2 and policy.reservation.held == {1, 2}
    # while both slots are held: the base model's and adapter 1's requests pass it, adapter 2's and cold ones wait
    policy.observe_running([long1, short2])
    assert _ids(policy.sort_waiting(waiting)) == ["hot1", "base", "aged3", "hot2", "cold4"]
    assert policy.wait_for_lora_slot(waiting[0]) and policy.reservation.draining == 2  # the choice sticks
    policy.observe_running([long1, waiting[1]])  # adapter 2 drained: its slot is the reserving request's
    assert _ids(policy.sort_waiting(waiting))[0] == "aged3"
    policy.on_admitted(waiting[0])
    assert policy.reservation is None
    assert policy.wait_for_lora_slot(_request("base2", 0, 0.0)) is False  # the base model never needs a slot


def _first_step_of_the_cold_request(policy) -> int:
    """Adapter-1 requests arrive every step for 40 steps (``max_loras=1``: adapter 1 always holds the slot); one
    adapter-2 request arrives at step 1. The step at which it is first scheduled."""
    sched = Scheduler(policy, PagedKVAllocator(256, 4, True), StopChecker(tokenizer=None), max_num_seqs=16,
                      max_num_batched_tokens=256, max_model_len=64, max_loras=1)
    steps, first = [0], {}
    policy.use_clock(lambda: float(steps[0]))

    def record(_sched, out) -> None:
        if "cold" in _ids(out.scheduled_requests):
            first.setdefault("cold", steps[0])
        assert len({r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request}) <= 1
        steps[0] += 1

    arrivals = [Arrival(s, _request(f"hot{s}", 1, float(s), max_tokens=3)) for s in range(40)]
    simulate(sched, [*arrivals, Arrival(1, _request("cold", 2, 1.0))], after_step=record)
    return first["cold"]


def test_aging_bounds_the_wait_of_a_request_whose_adapter_never_gets_a_slot_otherwise():
    # aged after 5 steps, then admission holds until the running adapter-1 requests finish (prefill + 3 tokens)
    assert _first_step_of_the_cold_request(LoRAAffinityPolicy(aging_s=5.0)) <= 1 + 5 + 5
    # negative controls: without the bound it waits for the adapter-1 arrivals to stop, as under vLLM's skip rule
    assert _first_step_of_the_cold_request(LoRAAffinityPolicy(aging_s=math.inf)) >= 40
    assert _first_step_of_the_cold_request(FCFSPolicy()) >= 40


def _two_hot_streams_and_one_cold_request(policy) -> dict[str, int]:
    """``max_loras=2``: adapter-1 requests (``max_tokens=3``) arrive every step for 40 steps, adapter-2 ones
    (``max_tokens=6``) every step too, so both always hold a slot; one adapter-3 request arrives at step 1. The
    step at which each request is first scheduled (one clock unit per step), and under ``lora_affinity`` as
    ``"bound"`` the last step the module docstring's bound allows for the cold request: the step its reservation
    was made, plus the drained adapter's largest remaining work then (tokens; at least one per step), plus one."""
    sched = Scheduler(policy, PagedKVAllocator(512, 4, True), StopChecker(tokenizer=None), max_num_seqs=32,
                      max_num_batched_tokens=512, max_model_len=64, max_loras=2)
    steps, first = [0], {}
    policy.use_clock(lambda: float(steps[0]))

    def record(sched, out) -> None:
        for rid in _ids(out.scheduled_requests):
            first.setdefault(rid, steps[0])
        assert len({r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request}) <= 2
        reservation = getattr(policy, "reservation", None)
        if reservation is not None and "bound" not in first:  # made in this step's schedule; its update is applied
            drained = [r for r in sched.running if r.lora_request and r.lora_request.lora_int_id == reservation.draining]
            first["bound"] = steps[0] + max(map(remaining_work, drained)) + 1
        steps[0] += 1

    arrivals = [Arrival(s, _request(f"a{lora}-{s}", lora, float(s), max_tokens=3 * lora))
                for s in range(40) for lora in (1, 2)]
    simulate(sched, [*arrivals, Arrival(1, _request("cold", 3, 1.0))], after_step=record)
    return first


def test_hot_requests_pass_an_aged_request_waiting_for_a_slot():
    """The old rule held every admission behind the aged request until a slot freed; now the adapter that drains
    soonest (adapter 1: 3 tokens against 6) admits nothing new, and adapter 2's requests keep running."""
    first = _two_hot_streams_and_one_cold_request(LoRAAffinityPolicy(aging_s=5.0))
    cold = first["cold"]
    assert 1 + 5 < cold  # it aged (step 6), then waited for a slot
    assert all(first[f"a2-{s}"] < cold for s in range(1, cold - 1))  # young adapter-2 requests passed it
    assert all(first[f"a1-{s}"] > cold for s in range(1 + 5, cold - 1))  # adapter 1 drained for it


def test_the_aged_request_gets_a_slot_within_the_bound():
    """The starvation bound: the cold request, aged at step 6 (arrived at 1, ``aging_s=5``), is scheduled no later
    than its reservation's step plus the drained adapter's remaining work plus one. Negative controls: with aging
    off, or under ``fcfs``, it waits for the arrivals to stop."""
    first = _two_hot_streams_and_one_cold_request(LoRAAffinityPolicy(aging_s=5.0))
    assert first["bound"] <= 1 + 5 + 1 + 7 + 1  # reserved when aged; at most a 4-token prompt + 3 tokens to drain
    assert first["cold"] <= first["bound"]
    assert _two_hot_streams_and_one_cold_request(LoRAAffinityPolicy(aging_s=math.inf))["cold"] >= 40
    assert _two_hot_streams_and_one_cold_request(FCFSPolicy())["cold"] >= 40


peft = pytest.importorskip("peft")
PROMPTS = ["Once upon a time", "The cat sat on", "Lily went to the park", "Tom had a red ball", "One day, a bird"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[LoRARequest]:
    """Three PEFT adapters of stories260K (random A and B), saved as PEFT saves them."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("affinity_adapters")
    out = []
    for i, targets in enumerate([["q_proj", "v_proj"], ["o_proj", "down_proj"], ["k_proj", "up_proj"]], start=1):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          init_lora_weights=False))
        model.save_pretrained(root / f"a{i}")
        out.append(LoRARequest(f"a{i}", i, str(root / f"a{i}")))
    return out


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_engine_outputs_equal_fcfs_and_no_step_exceeds_max_loras(adapters):
    from framework import LLM

    prompts = [p for p in PROMPTS for _ in range(3)]  # 15 requests over 3 adapters and the base model
    loras = [(adapters + [None])[i % 4] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for name in ("fcfs", "lora_affinity"):
        llm = LLM(STORIES, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4, num_blocks=128,
                  max_num_seqs=4, scheduler=name)
        seen: list[set[int]] = []
        schedule = llm.engine.scheduler.schedule

        def recording_schedule(schedule=schedule, seen=seen):
            out = schedule()
            seen.append({r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request is not None})
            return out

        llm.engine.scheduler.schedule = recording_schedule
        outs = llm.generate(prompts, params, lora_request=loras)
        assert max(len(s) for s in seen) <= 2
        results[name] = [o.outputs[0].token_ids for o in outs]
    assert results["lora_affinity"] == results["fcfs"]
