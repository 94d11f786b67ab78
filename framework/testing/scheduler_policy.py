"""Scheduler-policy contract (``framework.interfaces.SchedulerPolicy``): pure keys, valid victims,
and, with a model, an engine run under KV pressure that finishes every request with greedy outputs
equal to ``fcfs``'s (a policy reorders work; it must never change what a request generates)."""

from __future__ import annotations

import copy
import random

from framework.core.lora_request import LoRARequest
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.interfaces import SchedulerPolicy


def _requests(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(request_id=f"r{i}", prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))],
                    sampling_params=SamplingParams(max_tokens=rng.randint(1, 16)), priority=rng.randint(-2, 2),
                    arrival_time=float(rng.randint(0, 5))) for i in range(n)]


def check_policy_contract(policy_cls: type[SchedulerPolicy], seed: int = 0) -> None:
    """Unit contract, no model: ``key`` is a deterministic, comparable tuple that does not mutate the
    request; ``select_victim`` returns a member of the running list without mutating it;
    ``may_preempt`` returns a bool; after ``attach`` (the scheduler's read-only prefix lookup) and
    ``observe_running`` (the running set, some requests under LoRA adapters), ``sort_waiting`` returns a
    permutation of the waiting queue without mutating it, ``wait_for_lora_slot`` returns a bool without mutating
    the request, and ``on_admitted`` accepts every request.

    Raises:
        AssertionError: naming the broken contract.
    """
    assert issubclass(policy_cls, SchedulerPolicy), f"{policy_cls!r} must subclass SchedulerPolicy"
    assert policy_cls.name, f"{policy_cls.__name__}.name (the registry key) must be set"
    policy = policy_cls()
    reqs = _requests(32, seed)
    for req in reqs:
        before = copy.copy(req.__dict__)
        key = policy.key(req)
        assert isinstance(key, tuple), f"{policy_cls.name}.key must return a tuple, got {type(key).__name__}"
        assert policy.key(req) == key, f"{policy_cls.name}.key must be deterministic"
        assert req.__dict__ == before, f"{policy_cls.name}.key must not mutate the request"
    sorted(reqs, key=policy.key)  # keys of different requests must be mutually comparable
    running = reqs[:8]
    snapshot = list(running)
    victim = policy.select_victim(running)
    assert victim in snapshot and running == snapshot, f"{policy_cls.name}.select_victim must return one of " \
        "the running requests and leave the list unchanged"
    assert isinstance(policy.may_preempt(reqs[9], victim), bool), f"{policy_cls.name}.may_preempt must return a bool"
    policy.attach(lambda request: len(request.prompt_token_ids) // 2)
    for i, req in enumerate(reqs):  # a third of the requests under one of two adapters
        req.lora_request = LoRARequest(f"adapter{i % 2}", 1 + i % 2, "/adapters/x") if i % 3 == 0 else None
    policy.observe_running(running)
    assert running == snapshot, f"{policy_cls.name}.observe_running must not mutate the running list"
    waiting = reqs[8:]
    snapshot = list(waiting)
    ordered = policy.sort_waiting(waiting)
    assert waiting == snapshot, f"{policy_cls.name}.sort_waiting must not mutate the queue it is given"
    assert sorted(r.request_id for r in ordered) == sorted(r.request_id for r in snapshot), \
        f"{policy_cls.name}.sort_waiting must return the same requests (a permutation)"
    for req in ordered:
        before = copy.copy(req.__dict__)
        assert isinstance(policy.wait_for_lora_slot(req), bool), f"{policy_cls.name}.wait_for_lora_slot must " \
            "return a bool"
        assert req.__dict__ == before, f"{policy_cls.name}.wait_for_lora_slot must not mutate the request"
        policy.on_admitted(req)


def check_scheduler_policy(policy_cls: type[SchedulerPolicy], model: str | None = None, num_blocks: int = 12) -> None:
    """The unit contract, then (with ``model``, a tiny float32 model dir such as stories260K) an engine
    run of 6 greedy requests (max_model_len 40) with ``num_blocks`` KV blocks of 4 tokens (forces preemption): every
    request finishes, no block leaks, and outputs equal an ``fcfs`` run with ample KV.

    ``policy_cls`` must be registered (installed entry point) under ``policy_cls.name``.

    Raises:
        AssertionError: naming the broken contract.
    """
    check_policy_contract(policy_cls)
    if model is None:
        return
    from framework import LLM

    prompts = [[(7 * i + j) % 400 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = LLM(model=model, scheduler="fcfs", block_size=4, num_blocks=256, max_model_len=40).generate(prompts, params)
    llm = LLM(model=model, scheduler=policy_cls.name, block_size=4, num_blocks=num_blocks, max_model_len=40)
    outputs = llm.generate(prompts, params, priority=[i % 3 for i in range(6)])
    for ref, out in zip(reference, outputs):
        assert out.finished and out.error is None, f"{out.request_id} did not finish: {out.error}"
        assert list(out.outputs[0].token_ids) == list(ref.outputs[0].token_ids), \
            f"{policy_cls.name}: greedy output of {out.request_id} differs from fcfs (a policy must only reorder)"
    kv = llm.engine.kv_allocator
    assert not llm.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"
