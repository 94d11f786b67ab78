"""``scheduler=lora_affinity``: its order (aged, then the base model's and loaded adapters' requests, then the other
adapters grouped), its starvation bound against the real ``Scheduler`` (model-free, one clock unit per step; with
aging off, the negative control starves), and an engine run on stories260K with PEFT adapters whose greedy outputs
equal ``fcfs``'s while no step holds more than ``max_loras`` adapters."""

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
from plugins.schedulers.lora_affinity import LoRAAffinityPolicy
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
    assert not any(policy.wait_for_lora_slot(r) for r in waiting)
    now[0] = 100.5  # r1 (arrived at 0) has waited aging_s: it goes first and holds admission for a slot
    assert _ids(policy.sort_waiting(waiting))[:2] == ["r1", "r2"]
    assert policy.wait_for_lora_slot(waiting[0]) and not policy.wait_for_lora_slot(waiting[1])
    policy.observe_running([])  # nothing loaded: every adapter is cold, the base model stays first
    now[0] = 6.0
    assert _ids(policy.sort_waiting(waiting)) == ["r3", "r1", "r5", "r2", "r7", "r4", "r6"]
    with pytest.raises(ValueError, match="aging_s"):
        LoRAAffinityPolicy(aging_s=0)


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
