"""Online serving benchmark against any OpenAI-compatible endpoint (ours, vLLM, SGLang), in the shape of
``vllm bench serve``.

Requests come from any servelab workload (``conf/workload/<name>.yaml`` + ``key=value`` overrides, built
with the model's tokenizer): text prompts go out as text, token-id workloads (``random``,
``shared_prefix``, ...) as token-id prompts on ``/v1/completions``. Arrivals: ``--request-rate`` (req/s;
``inf`` = all at once) with Poisson (``--burstiness 1``) or gamma gaps (``< 1`` burstier), as vLLM's
benchmark; without ``--request-rate`` the workload's own arrival times (``workload.request_rate``,
``workload.trace``) are used. ``--max-concurrency`` caps requests in flight. Every request streams
(``stream_options.include_usage`` gives the exact output token count).

Metrics (vLLM definitions): TTFT = first content chunk - send; ITL = gaps between content chunks;
TPOT = (e2e - TTFT) / (output tokens - 1); e2el = last byte - send. Goodput counts completed requests
meeting every SLO of ``--goodput ttft:MS tpot:MS e2el:MS`` (DistServe, OSDI'24). Results: a table on
stdout and ``--result-file`` JSON with vLLM's keys (``request_throughput``, ``output_throughput``,
``mean_ttft_ms``, ``p99_itl_ms``, ``ttfts``, ``itls``, ...).

Example (server: ``python run.py mode=serve model=smollm2 server.port=8000``)::

    .venv/bin/python -m experiments.serving.bench_serving --base-url http://127.0.0.1:8000 --model smollm2 \
        --workload random workload.num_prompts=200 --request-rate 4 --result-file experiments/results/serve_rate4.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from framework.metrics.collector import percentile  # noqa: E402
from framework.workloads.item import WorkloadItem  # noqa: E402


@dataclass
class RequestResult:
    """One benchmarked request; times in seconds (``time.perf_counter``)."""

    success: bool = False
    prompt_len: int = 0  # prompt tokens (from usage; else the workload's count)
    output_tokens: int = 0  # from usage, else the number of content chunks
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    generated_text: str = ""
    error: str = ""


def load_items(workload: str, overrides: list[str], model: str) -> list[WorkloadItem]:
    """The workload's requests (with arrival offsets), built by ``framework.workloads.workload.build_workload`` with the
    tokenizer and vocabulary size of ``model`` (a servelab alias or local folder), exactly as
    ``python run.py workload=<workload> <overrides>`` builds them (same seed -> same prompts).

    Raises:
        ValueError: unknown workload or bad parameters (from ``build_workload``).
    """
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from framework.entrypoints.hydra_config import CONF_DIR
    from framework.model_executor.model_loader import load_model_config, resolve_model_path
    from framework.workloads.workload import build_workload

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"workload={workload}", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), local_files_only=True)
    config = load_model_config(model)  # same vocab/length bounds as run.py, so the same seed gives the same prompts
    return build_workload(cfg.workload, tokenizer, vocab_size=config.vocab_size,
                          max_model_len=getattr(config, "max_position_embeddings", None))


def arrival_offsets(items: list[WorkloadItem], rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Send offsets (s from start): gamma gaps with mean ``1/rate`` and shape ``burstiness`` (1 = Poisson), all 0
    for ``rate=inf``, or the workload's own ``arrival_time_s`` when ``rate`` is None."""
    if rate is None:
        return [item.arrival_time_s or 0.0 for item in items]
    if rate == float("inf"):
        return [0.0] * len(items)
    rng, t, out = random.Random(seed), 0.0, []
    for _ in items:
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


async def send(session: Any, args: argparse.Namespace, item: WorkloadItem) -> RequestResult:
    """Stream one request; never raises (failures are ``success=False`` with ``error``)."""
    prompt: Any = item.prompt_token_ids if item.prompt_token_ids is not None else item.prompt
    body: dict[str, Any] = {"model": args.model, "max_tokens": item.max_tokens or args.max_tokens,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = prompt
    url = f"{args.base_url.rstrip('/')}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = RequestResult(prompt_len=len(item.prompt_token_ids or []))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    result.error = data["error"].get("message", str(data))
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                    result.prompt_len = data["usage"]["prompt_tokens"]
                for choice in data.get("choices") or []:
                    text = choice.get("text") if args.endpoint != "chat" else (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last, chunks = now, chunks + 1
                        result.generated_text += text
        result.e2el_s = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = chunks > 0 or result.output_tokens > 0
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run(args: argparse.Namespace, items: list[WorkloadItem]) -> tuple[list[RequestResult], float]:
    """Send every item at its offset (at most ``max_concurrency`` in flight); returns results and duration (s)."""
    import aiohttp

    offsets = arrival_offsets(items, args.request_rate, args.burstiness, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()

        async def one(item: WorkloadItem, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if limit is None:
                return await send(session, args, item)
            async with limit:
                return await send(session, args, item)

        results = await asyncio.gather(*[one(item, at) for item, at in zip(items, offsets)])
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float, slo_ms: dict[str, float],
              percentiles: list[float]) -> dict[str, Any]:
    """vLLM ``bench serve`` metrics: throughputs (per s of ``duration_s``), goodput, mean/median/std/pXX in ms."""
    ok = [r for r in results if r.success]
    tpots = [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    series = {"ttft": [r.ttft_s for r in ok], "tpot": tpots, "itl": [g for r in ok for g in r.itl_s],
              "e2el": [r.e2el_s for r in ok]}

    def meets(r: RequestResult) -> bool:
        tpot = (r.e2el_s - r.ttft_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        values = {"ttft": r.ttft_s, "tpot": tpot, "e2el": r.e2el_s}
        return all(values[k] * 1000 <= v for k, v in slo_ms.items())

    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration_s, "output_throughput": n_out / duration_s,
        "total_token_throughput": (n_in + n_out) / duration_s,
        "request_goodput": sum(meets(r) for r in ok) / duration_s if slo_ms else None,
    }
    for name, values in series.items():
        ms = [v * 1000 for v in values] or [float("nan")]
        mean = sum(ms) / len(ms)
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = mean, percentile(ms, 50)
        out[f"std_{name}_ms"] = (sum((v - mean) ** 2 for v in ms) / len(ms)) ** 0.5
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def print_report(summary: dict[str, Any], percentiles: list[float]) -> None:
    """The ``vllm bench serve`` console table."""
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput"):
        value = summary[key]
        print(f"{key:<45}{str(value) if not isinstance(value, float) else f'{value:.2f}':>15}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        print("{s:{c}^60}".format(s=f" {name.upper()} (ms) ", c="-"))
        for stat in ("mean", "median", *[f"p{p:g}" for p in percentiles]):
            print(f"{stat + ' ' + name:<45}{summary[f'{stat}_{name}_ms']:>15.2f}")
    print("=" * 60)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Flags plus ``workload.*`` Hydra overrides (any ``key=value`` argument)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name; also the tokenizer (servelab alias or folder)")
    p.add_argument("--tokenizer", default=None, help="tokenizer model when --model is only a served name")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("SERVELAB_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--workload", default="random", help="conf/workload/<name>; add workload.KEY=VALUE overrides")
    p.add_argument("--request-rate", type=float, default=None, help="req/s (inf = all at once); default: workload's")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64, help="for workload items without their own")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="vLLM extension: every request emits max_tokens")
    p.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    args, overrides = p.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    return args, overrides


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns (and optionally saves) the vLLM-shaped result dict."""
    args, overrides = parse_args(argv)
    slo_ms = {k: float(v) for k, v in (s.split(":", 1) for s in args.goodput)}
    unknown = set(slo_ms) - {"ttft", "tpot", "e2el"}
    if unknown:
        raise SystemExit(f"--goodput keys must be ttft, tpot or e2el; got {sorted(unknown)}")
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    items = load_items(args.workload, overrides, args.tokenizer or args.model)
    results, duration = asyncio.run(run(args, items))
    summary = summarize(results, duration, slo_ms, percentiles)
    print_report(summary, percentiles)
    record = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": args.base_url,
              "endpoint": args.endpoint, "model_id": args.model, "tokenizer_id": args.tokenizer or args.model,
              "workload": args.workload, "workload_overrides": overrides, "num_prompts": len(items),
              "request_rate": args.request_rate if args.request_rate is not None else "workload",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "goodput_slo_ms": slo_ms,
              **summary, "input_lens": [r.prompt_len for r in results],
              "output_lens": [r.output_tokens for r in results], "ttfts": [r.ttft_s for r in results],
              "itls": [r.itl_s for r in results], "generated_texts": [r.generated_text for r in results],
              "errors": [r.error for r in results]}
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
