"""KV correctness without a model: every slot a scheduled request reads holds the K/V of its own prefix.

Drives the real ``Scheduler`` with every registered allocator x policy (x preemption mode) through
random arrivals, priorities, overlapping prompts, budgets and pool sizes, checking each step with
``framework.testing.shadow_cache``. Allocators with KV cache groups also get a random model shape
(full attention, all sliding, mixed full/sliding, Gemma-3-like one full + two sliding groups, two
windows) with windows of 1 to 3 blocks + 2 tokens, so out-of-window blocks are released all the time.
Includes the regression scenario of a same-step preemption that used to leave never-written blocks
in the prefix cache.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framework import registry
from framework.core.lora_request import LoRARequest
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.core.swap import SwapSpace
from framework.testing.shadow_cache import Arrival, kv_cache_group_layouts, simulate
from plugins.kv_allocators._eviction import EVICTION_POLICIES

POLICIES = sorted(registry.available("scheduler"))
# every registered allocator; paged once per eviction policy
ALLOCATORS = [("paged", {"eviction": e}) for e in EVICTION_POLICIES] + [
    (name, {}) for name in sorted(registry.available("kv_allocator")) if name != "paged"]


def make_scheduler(allocator: tuple[str, dict], policy: str, *, num_blocks: int, block_size: int,
                   max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, max_model_len: int | None = None,
                   long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
                   swap_slots: int = 0, kv_cache_groups: tuple | None = None, max_loras: int = 0) -> Scheduler:
    """A scheduler over a fresh pool of ``allocator = (name, params)`` with ``policy`` (registry names);
    ``kv_cache_groups`` go to allocators that support them (the pool then grows by their number)."""
    name, params = allocator
    max_model_len = max_model_len or num_blocks * block_size
    if kv_cache_groups and registry.get_class("kv_allocator", name).supports_kv_cache_groups:
        params = {**params, "kv_cache_groups": kv_cache_groups}
        num_blocks *= len(kv_cache_groups)
    kv = registry.create("kv_allocator", name, num_blocks=num_blocks, block_size=block_size,
                         enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len, **params)
    return Scheduler(registry.create("scheduler", policy), kv, StopChecker(tokenizer=None),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len,
                     long_prefill_token_threshold=long_prefill_token_threshold,
                     swap_space=SwapSpace(swap_slots) if swap_slots else None, max_loras=max_loras)


def request(rid: str, tokens: list[int], max_tokens: int, priority: int = 0, arrival: float = 0.0,
            lora: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=arrival,
                   eos_token_ids=frozenset(), lora_request=LoRARequest(f"a{lora}", lora, f"/a{lora}") if lora else None)


def _invariants(sched: Scheduler, _out) -> None:
    if hasattr(sched.kv, "check_invariants"):
        sched.kv.check_invariants()


def test_same_step_preemption_leaves_no_unwritten_block_in_the_prefix_cache():
    """The issue's reproduction: the 24-token request gets slots (publishing blocks that would be
    full after the step), is preempted in the same step by the priority-0 arrival, and on
    re-admission must not hit blocks whose K/V was never computed."""
    sched = make_scheduler(("paged", {}), "priority", num_blocks=7, block_size=4, max_model_len=28,
                           long_prefill_token_threshold=8)
    long = request("long", list(range(100, 124)), max_tokens=4, priority=5, arrival=0.0)
    short = request("short", [5, 6, 7, 8], max_tokens=2, priority=0, arrival=1.0)
    simulate(sched, [Arrival(0, long), Arrival(1, short)], after_step=_invariants)
    assert long.num_preemptions >= 1  # the scenario really preempted


@st.composite
def layouts(draw: st.DrawFn, block_size: int) -> tuple:
    """A model shape (KV cache groups) with windows of 1 .. 3 blocks + 2 tokens."""
    windows = draw(st.lists(st.integers(1, 3 * block_size + 2), min_size=2, max_size=2))
    return draw(st.sampled_from(kv_cache_group_layouts(windows)))


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    """Random pool/budget knobs and requests that share prefixes, with arrival steps and priorities."""
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(4, 16))
    max_model_len = num_blocks * block_size
    base = draw(st.lists(st.integers(3, 6), min_size=max_model_len, max_size=max_model_len))
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        n_shared = draw(st.integers(0, max_model_len // 2))
        n_own = draw(st.integers(1 if n_shared else 1, max(1, max_model_len // 2)))
        tokens = base[:n_shared] + draw(st.lists(st.integers(3, 9), min_size=n_own, max_size=n_own))
        tokens = tokens[:max_model_len - 1]
        max_tokens = draw(st.integers(1, max(1, min(6, max_model_len - len(tokens)))))
        reqs.append((f"r{i}", tokens, max_tokens, draw(st.integers(0, 3)), draw(st.integers(0, 4))))
    return dict(block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len,
                max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(max(4, block_size), 48)),
                long_prefill_token_threshold=draw(st.sampled_from([0, 2, 3, 8])), reqs=reqs,
                caching=draw(st.booleans()), groups=draw(layouts(block_size)))


@st.composite
def pressure_workloads(draw: st.DrawFn) -> dict:
    """KV pressure at the worst moment: a long low-priority prompt in chunks, and a short urgent one
    whose first decode needs a new block in the step the long one takes the pool's last blocks
    (the shape of the same-step-preemption bug), plus a few random requests sharing its prefix."""
    bs = draw(st.sampled_from([1, 2, 4]))
    thr = bs * draw(st.integers(1, 2))
    n_long = draw(st.integers(3 * thr, 6 * bs + 3 * thr))
    n_short = bs * draw(st.integers(1, 2))
    num_blocks = -(-n_long // bs) + n_short // bs + draw(st.sampled_from([0, 0, 1]))
    num_blocks = max(num_blocks, -(-(n_long + 1) // bs))
    max_model_len = num_blocks * bs
    long = list(range(10, 10 + n_long))
    short = draw(st.lists(st.integers(3, 9), min_size=n_short, max_size=n_short))
    reqs = [("long", long, draw(st.integers(1, 4)), 3, 0),
            ("short", short, draw(st.integers(1, 2 * bs + 1)), 0, max(1, -(-n_long // thr) - 2))]
    for i in range(draw(st.sampled_from([0, 0, 1, 2]))):
        tokens = long[:draw(st.integers(0, n_long))] + draw(st.lists(st.integers(3, 9), min_size=1, max_size=2 * bs))
        reqs.append((f"r{i}", tokens[:max_model_len - 1], draw(st.integers(1, 4)), draw(st.integers(0, 3)),
                     draw(st.integers(0, 4))))
    reqs = [(rid, t, min(m, max(1, max_model_len - len(t))), p, s) for rid, t, m, p, s in reqs]
    return dict(block_size=bs, num_blocks=num_blocks, max_model_len=max_model_len,
                max_num_seqs=draw(st.integers(2, 6)), max_num_batched_tokens=64, long_prefill_token_threshold=thr,
                reqs=reqs, caching=True, groups=draw(layouts(bs)))


def workload_scheduler(allocator: tuple[str, dict], policy: str, mode: str, w: dict,
                       loras: list[int] | None = None) -> tuple[Scheduler, list[Arrival]]:
    """A scheduler for workload ``w`` (``workloads()``/``pressure_workloads()``) in preemption ``mode`` (swap: a
    small swap space, so swaps and the recompute fallback both happen) and its arrivals; ``loras`` gives request
    ``i`` adapter ``loras[i]`` (0: the base model) and the scheduler ``max_loras=2``."""
    sched = make_scheduler(allocator, policy, num_blocks=w["num_blocks"], block_size=w["block_size"],
                           max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["max_num_batched_tokens"],
                           max_model_len=w["max_model_len"],
                           long_prefill_token_threshold=w["long_prefill_token_threshold"],
                           enable_prefix_caching=w["caching"],
                           swap_slots=w["num_blocks"] // 2 if mode == "swap" else 0, kv_cache_groups=w["groups"],
                           max_loras=2 if loras is not None else 0)
    arrivals = [Arrival(step, request(rid, tokens, max_tokens, priority, arrival=float(step),
                                      lora=loras[i] if loras is not None else 0))
                for i, (rid, tokens, max_tokens, priority, step) in enumerate(w["reqs"])]
    return sched, arrivals


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: "-".join([a[0], *map(str, a[1].values())]))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.one_of(workloads(), pressure_workloads()))
def test_shadow_cache_random_workloads(allocator: str, policy: str, mode: str, w: dict) -> None:
    sched, arrivals = workload_scheduler(allocator, policy, mode, w)
    simulate(sched, arrivals, after_step=_invariants)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: "-".join([a[0], *map(str, a[1].values())]))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.one_of(workloads(), pressure_workloads()), k=st.integers(1, 4), seed=st.integers(0, 1 << 16))
def test_shadow_cache_with_speculative_steps(allocator: str, policy: str, mode: str, w: dict, k: int,
                                            seed: int) -> None:
    """Speculative decoding (random drafts, random acceptance): rejected drafts' K/V is never read
    before it is overwritten and never served from the prefix cache."""
    sched, arrivals = workload_scheduler(allocator, policy, mode, w)
    simulate(sched, arrivals, after_step=_invariants, num_speculative_tokens=k, seed=seed)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", ALLOCATORS, ids=lambda a: "-".join([a[0], *map(str, a[1].values())]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.one_of(workloads(), pressure_workloads()))
def test_shadow_cache_with_two_batches_in_flight(allocator: str, policy: str, mode: str, w: dict) -> None:
    """Pipeline parallelism's batch queue (two batches in flight, scheduled before the older one's output is
    applied): no stale read, in-flight requests never preempted, and every request finishes (a preemption that
    evicted a higher-ranked request in place of an in-flight victim thrashed without end)."""
    sched, arrivals = workload_scheduler(allocator, policy, mode, w)
    simulate(sched, arrivals, after_step=_invariants, batches_in_flight=2)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# the allocators LoRA runs with (framework/engine/lora_support.py): their prefix hashes are salted by adapter
LORA_ALLOCATORS = [a for a in ALLOCATORS if a[0] in ("paged", "contiguous")]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", LORA_ALLOCATORS, ids=lambda a: "-".join([a[0], *map(str, a[1].values())]))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=st.one_of(workloads(), pressure_workloads()), loras=st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_shadow_cache_with_lora_adapters(allocator: str, policy: str, mode: str, w: dict, loras: list[int]) -> None:
    """Requests under LoRA adapters (0: the base model) sharing prefixes, ``max_loras=2``: no request reads K/V
    written under another adapter (the fingerprints are salted by adapter), no step holds more than two adapters,
    and every request finishes (``lora_affinity``'s aging bound on the engine's step clock included)."""
    sched, arrivals = workload_scheduler(allocator, policy, mode, w, loras=loras)
    steps = [0]
    sched.policy.use_clock(lambda: float(steps[0]))  # arrivals are step numbers: age on that clock

    def check(sched: Scheduler, out) -> None:
        _invariants(sched, out)
        assert len({r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request}) <= 2
        steps[0] += 1

    simulate(sched, arrivals, after_step=check)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_speculative_simulation_really_speculates():
    """Guard for the test above: drafts are scheduled and some are rejected."""
    sched = make_scheduler(ALLOCATORS[0], "fcfs", num_blocks=16, block_size=2)
    seen = {"drafts": 0}

    def count(_sched, out):
        seen["drafts"] += sum(map(len, out.scheduled_spec_decode_tokens.values()))

    arrivals = [Arrival(0, request(f"r{i}", [3 + i, 4, 5], max_tokens=8)) for i in range(3)]
    simulate(sched, arrivals, after_step=count, num_speculative_tokens=3, seed=1)
    assert seen["drafts"] > 0
