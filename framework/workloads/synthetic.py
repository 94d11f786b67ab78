"""Seeded synthetic workloads for scheduling/KV ablations and online arrival processes.

Workloads (token-id prompts, nothing downloaded):

* ``shared_prefix`` — N system prompts x M questions (SGLang's few-shot / system-prompt sharing);
* ``multi_turn`` — conversations whose every turn extends the previous turn's prompt (chat reuse);
* ``long_tail`` — log-normal prompt/output lengths with p50 ≈ 128 and p99 ≈ 4096 tokens, clipped
  to the model (real traffic's skew, e.g. the ShareGPT/LMSYS length distributions).

Arrivals (vLLM ``benchmark_serving``): ``request_rate`` req/s with ``poisson`` (exponential gaps)
or ``gamma`` (shape ``burstiness``, same mean: < 1 burstier, > 1 more regular), or a ``trace`` file
of arrival times. :func:`theoretical_hit_rate` is the best prefix-cache hit rate any cache could reach
on a workload (infinite capacity, block-aligned), reported next to the measured one.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from framework.workloads.item import MIN_RANDOM_TOKEN_ID, WorkloadItem

ARRIVALS = ("poisson", "gamma")
LONG_TAIL_P50, LONG_TAIL_P99 = 128, 4096  # tokens
_Z99 = 2.3263478740408408  # standard normal 99th percentile


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_RANDOM_TOKEN_ID, vocab_size) for _ in range(n)]


def shared_prefix_workload(num_prefixes: int, questions_per_prefix: int, prefix_len: int, question_len: int,
                           output_len: int, seed: int, vocab_size: int) -> list[WorkloadItem]:
    """``num_prefixes`` random system prompts of ``prefix_len`` tokens, each followed by
    ``questions_per_prefix`` random questions of ``question_len`` tokens; interleaved so that
    prefixes alternate (the order a cache-aware policy such as ``lpm`` can improve).

    Raises:
        ValueError: a non-positive count or length.
    """
    if min(num_prefixes, questions_per_prefix, prefix_len, question_len, output_len) < 1:
        raise ValueError("shared_prefix needs num_prefixes, questions_per_prefix, prefix_len, question_len and "
                         "output_len >= 1")
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    items = []
    for q in range(questions_per_prefix):
        for p, prefix in enumerate(prefixes):
            items.append(WorkloadItem(request_id=f"sp{p}-q{q}", prompt_token_ids=prefix + _ids(rng, question_len,
                                                                                               vocab_size),
                                      max_tokens=output_len, client_id=f"prefix-{p}"))
    return items


def multi_turn_workload(num_conversations: int, turns: int, first_len: int, turn_len: int, output_len: int,
                        turn_gap_s: float, seed: int, vocab_size: int) -> list[WorkloadItem]:
    """Conversations of ``turns`` requests; turn ``t`` re-sends turn ``t - 1``'s prompt plus a
    ``output_len``-token stand-in for the previous answer and a ``turn_len``-token new user message,
    arriving ``turn_gap_s`` after the previous turn (offsets from the run start, seconds).

    Raises:
        ValueError: a non-positive count or length, or a negative gap.
    """
    if min(num_conversations, turns, first_len, turn_len, output_len) < 1 or turn_gap_s < 0:
        raise ValueError("multi_turn needs positive counts/lengths and turn_gap_s >= 0")
    rng = random.Random(seed)
    items = []
    for c in range(num_conversations):
        prompt = _ids(rng, first_len, vocab_size)
        for t in range(turns):
            if t:
                prompt = prompt + _ids(rng, output_len + turn_len, vocab_size)
            items.append(WorkloadItem(request_id=f"conv{c}-turn{t}", prompt_token_ids=list(prompt),
                                      max_tokens=output_len, arrival_time_s=t * turn_gap_s, client_id=f"conv-{c}"))
    return items


def long_tail_workload(num_prompts: int, seed: int, vocab_size: int, max_model_len: int,
                       p50: int = LONG_TAIL_P50, p99: int = LONG_TAIL_P99) -> list[WorkloadItem]:
    """Log-normal prompt and output lengths with the given median and 99th percentile, tokens;
    each request is clipped so that prompt + output <= ``max_model_len`` (prompt first).

    Raises:
        ValueError: ``num_prompts < 1``, ``p99 <= p50`` or ``max_model_len < 2``.
    """
    if num_prompts < 1 or p99 <= p50 or max_model_len < 2:
        raise ValueError("long_tail needs num_prompts >= 1, p99 > p50 and max_model_len >= 2")
    mu, sigma = math.log(p50), math.log(p99 / p50) / _Z99
    rng = random.Random(seed)
    items = []
    for i in range(num_prompts):
        n_in = min(max(1, round(rng.lognormvariate(mu, sigma))), max_model_len - 1)
        n_out = min(max(1, round(rng.lognormvariate(mu, sigma))), max_model_len - n_in)
        items.append(WorkloadItem(request_id=f"lt{i}", prompt_token_ids=_ids(rng, n_in, vocab_size), max_tokens=n_out))
    return items


def validate_arrivals(cfg: Mapping[str, Any]) -> list[float] | None:
    """Check the arrival keys of a ``workload`` config; returns the trace's times when one is given.

    Keys: ``request_rate`` (req/s, null/inf = all at start), ``arrival`` (poisson|gamma),
    ``burstiness`` (gamma shape > 0), ``trace`` (a file: one arrival time in seconds per line, or a
    JSON list; non-negative and sorted).

    Raises:
        ValueError: ``request_rate <= 0``, an unknown ``arrival``, ``burstiness <= 0``, a trace with
            negative or unsorted times, or both a trace and a rate.
        FileNotFoundError: a missing trace file.
    """
    rate, trace = cfg.get("request_rate"), cfg.get("trace")
    if rate is not None and not rate > 0:
        raise ValueError(f"workload.request_rate must be > 0 req/s (or null for all at start), got {rate}")
    arrival = cfg.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        raise ValueError(f"workload.arrival must be one of {'|'.join(ARRIVALS)}, got {arrival!r}")
    if not float(cfg.get("burstiness", 1.0)) > 0:
        raise ValueError(f"workload.burstiness must be > 0, got {cfg.get('burstiness')}")
    if trace is None:
        return None
    if rate is not None:
        raise ValueError("give either workload.trace or workload.request_rate, not both")
    path = Path(trace)
    if not path.is_file():
        raise FileNotFoundError(f"arrival trace not found: {path} (set workload.trace=<file>)")
    text = path.read_text(encoding="utf-8").strip()
    times = [float(t) for t in (json.loads(text) if text.startswith("[") else text.split())]
    if any(t < 0 for t in times):
        raise ValueError(f"arrival trace {path} has negative times; times are seconds from the run start")
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError(f"arrival trace {path} is not sorted; list arrival times in increasing order")
    return times


def apply_arrivals(items: list[WorkloadItem], cfg: Mapping[str, Any], seed: int) -> list[WorkloadItem]:
    """Set ``arrival_time_s`` of ``items`` (in order) from the config's rate/process or trace.

    Items keep their own arrival offsets when neither a rate nor a trace is given; with a rate,
    per-item offsets (e.g. multi-turn gaps) are added to the arrival of the item's first request.

    Raises:
        ValueError: see :func:`validate_arrivals`; a trace shorter than the workload.
    """
    trace = validate_arrivals(cfg)
    rate = cfg.get("request_rate")
    if trace is not None:
        if len(trace) < len(items):
            raise ValueError(f"arrival trace has {len(trace)} times for {len(items)} requests")
        for item, t in zip(items, trace):
            item.arrival_time_s = t
        return items
    if rate is None or math.isinf(rate):
        return items
    rng = random.Random(seed + 7919)
    shape = float(cfg.get("burstiness", 1.0)) if cfg.get("arrival", "poisson") == "gamma" else 1.0
    t = 0.0
    for item in items:
        t += rng.gammavariate(shape, 1.0 / (rate * shape))  # mean gap 1/rate; shape 1 = exponential
        item.arrival_time_s = t + (item.arrival_time_s or 0.0)
    return items


def theoretical_hit_rate(items: list[WorkloadItem], block_size: int) -> float:
    """Best achievable prefix-cache hit rate (token-weighted, as ``KVCacheStats.hit_rate``): an
    infinite cache serves each request's longest block-aligned prefix shared with any earlier
    request (in arrival order), leaving at least one token to compute.

    Raises:
        ValueError: items without token ids (text prompts must be tokenized first).
    """
    seen: set[int] = set()
    queried = hit = 0
    for item in sorted(items, key=lambda it: it.arrival_time_s or 0.0):
        if item.prompt_token_ids is None:
            raise ValueError("theoretical_hit_rate needs token-id prompts")
        ids = item.prompt_token_ids
        queried += len(ids)
        h, hashes = 0, []
        for b in range(len(ids) // block_size):
            h = hash((h, tuple(ids[b * block_size:(b + 1) * block_size])))
            hashes.append(h)
        n = 0
        while n < min(len(hashes), (len(ids) - 1) // block_size) and hashes[n] in seen:
            n += 1
        hit += n * block_size
        seen.update(hashes)
    return hit / queried if queried else 0.0
