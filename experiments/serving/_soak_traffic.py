"""Traffic, checks and report of ``experiments/serving/soak_serving.py`` (see its docstring for what the soak does).

Each request is planned (:func:`plan_request`: what it sends and what it must get back), sent (:func:`send`:
streaming or not, possibly abandoned by its client) and recorded as a :class:`Outcome`; :func:`check_run` then
compares the records with each other, with the plan and with the server's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from framework.metrics.collector import percentile
from framework.testing.faulty_plugins import FAULT_STOP

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park.", "Lily found a red ball and",
           "A big fish swam in the sea. It was very hungry and", "Write one sentence about the sun:"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
# (share, kind): what a request is; the rest are plain
KINDS = [(0.05, "poisoned"), (0.05, "invalid"), (0.06, "abort_early"), (0.08, "disconnect"), (0.15, "structured")]


@dataclass
class Outcome:
    """One request as its client saw it; times in seconds from sending."""

    kind: str  # plain | structured | poisoned | invalid | abort_early | disconnect
    stream: bool
    outcome: str = ""  # finished | aborted | failed | refused | unexpected
    status: int = 0  # HTTP status (0: the client left before it)
    finish_reasons: list[str] = field(default_factory=list)  # one per choice, from the response or stream
    completion_tokens: int = 0  # usage.completion_tokens of a finished request
    ttft_s: float | None = None  # first content (stream) or the whole response (non-stream)
    e2e_s: float | None = None
    detail: str = ""  # error text, or why the outcome is unexpected


def plan_request(rng: random.Random, max_tokens: int) -> tuple[str, bool, dict[str, Any]]:
    """``(kind, stream, body)`` of one random request."""
    r, kind = rng.random(), "plain"
    for share, name in KINDS:
        if r < share:
            kind = name
            break
        r -= share
    stream = rng.random() < 0.5 or kind == "disconnect"
    body: dict[str, Any] = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, max_tokens),
                            "temperature": rng.choice([0.0, 0.7, 1.0]), "stream": stream}
    if rng.random() < 0.5:
        body.update(top_p=rng.choice([0.8, 0.95, 1.0]), top_k=rng.choice([0, 5, 50]), seed=rng.randint(0, 10**6))
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", " the", "!", "and"])]
    if rng.random() < 0.1:
        body["logit_bias"] = {str(rng.randint(3, 200)): rng.choice([-100.0, -5.0, 5.0])}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if kind == "structured":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        body["max_tokens"] = max(body["max_tokens"], 24)
    elif kind == "poisoned":
        # it must reach its decode phase (where the drafter sees it): at least 2 tokens, no early EOS
        body.update(stop=[FAULT_STOP], max_tokens=max(body["max_tokens"], 4), ignore_eos=True)
    elif kind == "invalid":
        body[rng.choice(["temperature", "max_tokens", "top_p"])] = -1
    elif kind in ("abort_early", "disconnect"):
        body["max_tokens"], body["ignore_eos"] = max_tokens, True
    return kind, stream, body


async def send(client: Any, base: str, kind: str, stream: bool, body: dict[str, Any], rng: random.Random) -> Outcome:
    """Send one planned request and classify what comes back."""
    out = Outcome(kind=kind, stream=stream)
    t0 = time.perf_counter()
    task = asyncio.ensure_future(_stream(client, base, body, out, t0) if stream else _plain(client, base, body, out, t0))
    if kind == "abort_early":  # the client gives up before (most likely) the first token
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        out.outcome = "aborted"
    except Exception as exc:  # noqa: BLE001 - any transport failure is a finding
        out.outcome, out.detail = "unexpected", f"{type(exc).__name__}: {exc}"
    if out.outcome == "aborted" and kind not in ("abort_early", "disconnect"):
        out.outcome = "unexpected"
    return out


async def _plain(client: Any, base: str, body: dict[str, Any], out: Outcome, t0: float) -> None:
    resp = await client.post(base + "/v1/completions", json=body)
    out.status, out.e2e_s = resp.status_code, time.perf_counter() - t0
    data = resp.json()
    if resp.status_code == 200:
        out.outcome, out.ttft_s = "finished", out.e2e_s
        out.finish_reasons = [c["finish_reason"] for c in data["choices"]]
        out.completion_tokens = data["usage"]["completion_tokens"]
    else:
        _error(out, resp.status_code, data.get("error", {}))


def _error(out: Outcome, status: int, error: dict[str, Any]) -> None:
    out.detail = str(error.get("message", ""))[:300]
    if 400 <= status < 500:
        out.outcome = "refused"
    elif status == 500 and error.get("code") == "internal_error":
        out.outcome = "failed"
    else:
        out.outcome = "unexpected"


async def _stream(client: Any, base: str, body: dict[str, Any], out: Outcome, t0: float) -> None:
    leave_after = random.Random(id(out)).randint(1, 6) if out.kind == "disconnect" else None
    done, events = 0, 0
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        out.status = resp.status_code
        if resp.status_code != 200:
            _error(out, resp.status_code, json.loads(await resp.aread()).get("error", {}))
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done += 1
                continue
            chunk, events = json.loads(data), events + 1
            if "error" in chunk:
                _error(out, 500 if chunk["error"].get("type") == "server_error" else 400, chunk["error"])
                continue
            for choice in chunk.get("choices", []):
                out.ttft_s = out.ttft_s or (time.perf_counter() - t0 if choice.get("text") else None)
                if choice.get("finish_reason"):
                    out.finish_reasons.append(choice["finish_reason"])
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            if leave_after is not None and events >= leave_after:
                out.outcome = "aborted"  # disconnect mid-stream
                return
    out.e2e_s = time.perf_counter() - t0
    if done != 1:
        out.outcome, out.detail = "unexpected", f"{done} [DONE] events"
    elif not out.outcome:
        out.outcome = "finished" if len(out.finish_reasons) == 1 and out.finish_reasons[0] != "abort" else "unexpected"
        out.detail = out.detail or ("" if out.outcome == "finished" else f"finish reasons {out.finish_reasons}")


async def run_traffic(base: str, args: Any, sample: Any) -> list[Outcome]:
    """``args.duration_s`` of traffic; ``sample(done)`` is called about every second with the requests done."""
    import httpx

    rng = random.Random(args.seed)
    records: list[Outcome] = []
    deadline = time.monotonic() + args.duration_s
    limits = httpx.Limits(max_connections=args.concurrency + args.burst_size + 4)

    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one() -> None:
            kind, stream, body = plan_request(rng, args.max_tokens)
            records.append(await send(client, base, kind, stream, body, rng))

        async def worker() -> None:
            while time.monotonic() < deadline:
                await one()

        async def bursts() -> None:
            while time.monotonic() + args.burst_every_s < deadline:
                await asyncio.sleep(args.burst_every_s)
                await asyncio.gather(*[one() for _ in range(args.burst_size)])

        async def sampler() -> None:
            while time.monotonic() < deadline:
                sample(len(records))
                await asyncio.sleep(1.0)

        await asyncio.gather(*[worker() for _ in range(args.concurrency)], bursts(), sampler())
    sample(len(records))
    return records


def _wait_idle(base: str, metrics: Any, timeout_s: float = 60.0) -> dict[str, float]:
    """``/metrics`` once no request runs or waits (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        idle = m["servelab:num_requests_running"] == 0 and m["servelab:num_requests_waiting"] == 0
        if (idle and m["servelab:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


MIN_REQUESTS_FOR_MEMORY = 300  # requests after warm-up below which memory growth is reported but not judged


def _memory_growth(samples: list[tuple[float, int, float]]) -> tuple[float, int]:
    """RSS growth per 1,000 requests after warm-up (the first third of the run), MiB, and the requests it spans."""
    warm = [s for s in samples if s[0] >= samples[0][0] + (samples[-1][0] - samples[0][0]) / 3] or samples
    (_, n0, m0), (_, n1, m1) = warm[0], warm[-1]
    return (0.0 if n1 <= n0 else (m1 - m0) / (n1 - n0) * 1000), n1 - n0


def check_run(base: str, records: list[Outcome], before: dict[str, float], samples: list[tuple[float, int, float]],
              max_growth: float, metrics: Any, live: list[tuple[int, float]] | None = None) -> dict[str, Any]:
    """Checks and summary of a finished run (see ``soak_serving`` for the list). ``live``: ``(requests done,
    RSS MiB after malloc_trim)`` at a third of the run and at its end; the memory check judges its growth
    (the raw RSS growth of ``samples`` when absent)."""
    import httpx

    after = _wait_idle(base, metrics)
    count = {o: sum(r.outcome == o for r in records) for o in ("finished", "aborted", "failed", "refused", "unexpected")}
    expect = {"poisoned": "failed", "invalid": "refused", "plain": "finished", "structured": "finished"}
    misplaced = [asdict(r) for r in records if r.kind in expect and r.outcome != expect[r.kind]]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(after) | set(before)}
    server_done = sum(delta.get(f"servelab:request_success_total[{r}]", 0.0) for r in ("stop", "length"))
    server_abort = delta.get("servelab:request_success_total[abort]", 0.0)
    engine_reached = count["finished"] + count["aborted"] + count["failed"]
    health = httpx.get(base + "/health", timeout=30).status_code
    probe = httpx.post(base + "/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=120).status_code
    raw_growth, num_measured = _memory_growth(samples)
    growth = raw_growth
    if live is not None and len(live) == 2 and live[1][0] > live[0][0]:
        (n0, m0), (n1, m1) = live
        growth, num_measured = (m1 - m0) / (n1 - n0) * 1000, n1 - n0
    judged = num_measured >= MIN_REQUESTS_FOR_MEMORY
    checks = {
        "answered_exactly_once": count["unexpected"] == 0 and not misplaced,
        "no_kv_leak": after["servelab:kv_cache_usage_perc"] == 0 and after["servelab:num_requests_running"] == 0
        and after["servelab:num_requests_waiting"] == 0,
        # a client may leave after its request finished on the server, never the other way round; aborts early
        # enough are never queued, so the server may count fewer requests than clients sent
        "metrics_match_clients": server_done >= count["finished"] and server_abort >= count["failed"]
        and server_done + server_abort <= engine_reached
        and delta.get("servelab:generation_tokens_total", 0.0) >= sum(r.completion_tokens for r in records
                                                                     if r.outcome == "finished"),
        "memory_flat": growth <= max_growth or not judged,
        "healthy_after": health == 200 and probe == 200,
    }
    ttft = [r.ttft_s for r in records if r.outcome == "finished" and r.ttft_s is not None] or [float("nan")]
    e2e = [r.e2e_s for r in records if r.outcome == "finished" and r.e2e_s is not None] or [float("nan")]
    return {"num_requests": len(records), "outcomes": count, "kinds": {k: sum(r.kind == k for r in records)
                                                                       for k in {r.kind for r in records}},
            "checks": checks, "misplaced": misplaced[:20],
            "unexpected": [asdict(r) for r in records if r.outcome == "unexpected"][:20],
            "server": {"finished": server_done, "aborted": server_abort,
                       "generation_tokens": delta.get("servelab:generation_tokens_total", 0.0),
                       "kv_cache_usage_end": after["servelab:kv_cache_usage_perc"],
                       "running_end": after["servelab:num_requests_running"],
                       "waiting_end": after["servelab:num_requests_waiting"]},
            "rss_mib_start": samples[0][2], "rss_mib_end": samples[-1][2], "rss_growth_mib_per_1k_requests": raw_growth,
            "live_mib": [m for _, m in live or []], "live_growth_mib_per_1k_requests": growth,
            "rss_growth_requests": num_measured, "rss_growth_judged": judged,
            "p50_ttft_ms": 1000 * percentile(ttft, 50), "p99_ttft_ms": 1000 * percentile(ttft, 99),
            "p50_e2e_ms": 1000 * percentile(e2e, 50), "p99_e2e_ms": 1000 * percentile(e2e, 99)}


def render_table(result: dict[str, Any]) -> str:
    """The soak's summary as a plain-text table."""
    o, s = result["outcomes"], result["server"]
    rows = [("requests", f"{result['num_requests']} ({', '.join(f'{k} {v}' for k, v in sorted(result['kinds'].items()))})"),
            ("outcomes", ", ".join(f"{k} {v}" for k, v in o.items())),
            ("server counters", f"finished {s['finished']:.0f}, aborted {s['aborted']:.0f}, "
                                f"generated tokens {s['generation_tokens']:.0f}"),
            ("KV leak", f"usage {s['kv_cache_usage_end']:.3f}, running {s['running_end']:.0f}, "
                        f"waiting {s['waiting_end']:.0f}"),
            ("resident memory", f"{result['rss_mib_start']:.0f} -> {result['rss_mib_end']:.0f} MiB, "
                                f"{result['rss_growth_mib_per_1k_requests']:+.2f} MiB per 1,000 requests after warm-up"),
            ("live memory (trimmed)", " -> ".join(f"{m:.0f}" for m in result["live_mib"]) + " MiB, "
                                      f"{result['live_growth_mib_per_1k_requests']:+.2f} MiB per 1,000 requests "
                                      f"({result['rss_growth_requests']} requests"
                                      + ("" if result["rss_growth_judged"] else ", too few to judge") + ")"),
            ("TTFT p50 / p99", f"{result['p50_ttft_ms']:.0f} / {result['p99_ttft_ms']:.0f} ms"),
            ("e2e p50 / p99", f"{result['p50_e2e_ms']:.0f} / {result['p99_e2e_ms']:.0f} ms")]
    rows += [(f"check {k}", "PASS" if v else "FAIL") for k, v in result["checks"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
