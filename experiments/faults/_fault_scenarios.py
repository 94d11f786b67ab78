"""The driver side of one fault-matrix row (``experiments/faults/fault_matrix.py``), run as a child process:
``python -m experiments.faults._fault_scenarios '<row as JSON>'``.

It builds an engine the way a user's script or server does and reports on stdout, one ``EVENT {json}`` line
each: ``phase`` (where it is, so the matrix knows when to strike), then ``outcome`` (what the user saw:
the exception or the server's answers, requests in flight, failed and served, ``time.time()`` of
detection). Faults that come from outside (signals) are the matrix's; faults that come from inside
(exceptions at per-request sites, a simulated out-of-memory, hangs) are injected here.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from experiments.common import REPO_ROOT  # noqa: E402
from framework import hookimpl  # noqa: E402

STORIES = str(REPO_ROOT / "models" / "stories260K")
PROMPTS = ["Once upon a time", "The little dog ran to the park and", "Lily wanted to play with her friend Tom.",
           "One day, a big bird"]


def emit(event: str, **fields: Any) -> None:
    """One event for the matrix (stdout, flushed)."""
    print("EVENT " + json.dumps({"event": event, **fields}), flush=True)


def engine_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    """The row's engine: stories260K over ``row['tp']`` ranks of ``row['executor']`` (``row['dp']`` replicas), its
    deadlines."""
    params = dict(row.get("executor_params", {}))
    if row["executor"] == "ray":
        params.setdefault("num_cpus_per_worker", 0.5)
    compiled = row.get("phase") == "compile"
    return {"model": STORIES, "executor": row["executor"], "tensor_parallel_size": row.get("tp", 1),
            "data_parallel_size": row.get("dp", 1),
            "executor_params": params, "compile": compiled, "max_model_len": 256,
            **({} if compiled else {"attention": "torch"}), **row.get("engine", {})}


def outcome(error: BaseException | None, num_requests: int, served: int, **extra: Any) -> None:
    """Report what the user saw, then exit as a user's script would (1 on an uncaught error)."""
    emit("outcome", at=time.time(), error=None if error is None else f"{type(error).__name__}: {_first_line(error)}",
         num_requests=num_requests, served=served, failed=num_requests - served, **extra)
    raise SystemExit(0 if error is None else 1)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


def long_params() -> Any:
    from framework import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=220, ignore_eos=True)


class _PhaseObserver:
    """Reports ``phase=step`` once the engine has run ``after`` steps (so a fault strikes mid-run)."""

    def __init__(self, after: int = 2) -> None:
        self.after, self.steps = after, 0

    @hookimpl
    def on_step_end(self, stats: Any) -> None:
        self.steps += 1
        if self.steps == self.after:
            emit("phase", phase="step", at=time.time())


def rank_fault(row: dict[str, Any]) -> None:
    """A signal to one rank, or a SIGKILL of the driver or of its process group (sent by the matrix) during
    ``row['phase']``: load, compile, step or idle."""
    from framework import LLM, registry
    from framework.interfaces import executor as executor_mod

    phase = row["phase"]
    if phase == "compile":
        initialize = executor_mod.Executor.initialize_cache

        def announced(self: Any, *args: Any, **kwargs: Any) -> None:
            emit("phase", phase="compile", at=time.time())
            initialize(self, *args, **kwargs)

        executor_mod.Executor.initialize_cache = announced
    observer = _PhaseObserver() if phase == "step" else object()  # idle: the warm-up generate must not announce
    if phase == "load":
        emit("phase", phase="load", at=time.time())
    try:
        with registry.registered(observer, name="fault-matrix-phase"):
            llm = LLM(**engine_kwargs(row))
            if phase == "idle":
                llm.generate(PROMPTS[:1], long_params())
                idle(llm)
            llm.generate(PROMPTS, long_params())
    except Exception as exc:  # noqa: BLE001 - what the user sees
        outcome(exc, len(PROMPTS) if phase in ("step",) else 0, 0)
    outcome(None, len(PROMPTS), len(PROMPTS))


def idle(llm: Any, wait_s: float = 120.0) -> None:
    """A server's engine loop (``AsyncLLM``) with nothing to do; the outcome is when it reports the loss."""
    from framework.engine.async_llm import AsyncLLM

    dead: list[BaseException] = []
    engine = AsyncLLM(llm.engine, on_dead=dead.append)
    emit("phase", phase="idle", at=time.time())
    end = time.monotonic() + wait_s
    while not dead and time.monotonic() < end:
        time.sleep(0.1)
    engine.shutdown(timeout_s=5)
    outcome(dead[0] if dead else None, 0, 0, server_exit="the server answers 503 and exits 1" if dead else None)


def request_faults(row: dict[str, Any]) -> None:
    """An exception at every per-request site, one site at a time, each with one poisoned request among
    sound ones: the poisoned one fails with an error naming the site, the others equal a run without faults."""
    from framework import LLM, SamplingParams, StructuredOutputsParams, registry
    from framework.core.detokenizer import IncrementalDetokenizer
    from framework.testing import faulty_plugins
    from framework.testing.fault_injection import WORKER_SITES, clear_worker_faults, inject_worker_fault
    from framework.testing.faulty_plugins import FAULT_STOP, InjectedFault

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}})
    sound = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(json=schema))]
    reach = {"min_tokens": {"min_tokens": 3}, "logit_bias": {"logit_bias": {5: 0.5}},
             "penalties": {"repetition_penalty": 1.2}, "top_k_top_p": {"temperature": 0.8, "top_k": 5, "seed": 3},
             "grammar_bitmask": {"structured_outputs": StructuredOutputsParams(json=schema)},
             "grammar 'faulty' fill_bitmask": {"structured_outputs": StructuredOutputsParams(
                 json=schema.replace('"object"', f'"object", "description": "{FAULT_STOP}"'))}}
    append = IncrementalDetokenizer.append

    def faulty_append(self: Any, token_id: int, check_stop: bool = True) -> Any:
        if FAULT_STOP in self.stop and os.environ.get("FAULT_SITE") == "detokenizer":
            raise InjectedFault("detokenizer")
        return append(self, token_id, check_stop)

    IncrementalDetokenizer.append = faulty_append
    emit("phase", phase="sites", at=time.time())
    results = []
    with registry.registered(faulty_plugins, name="faulty-plugins"):
        llm = LLM(**{**engine_kwargs(row), "grammar": "faulty", "drafter": "faulty"})
        baseline = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], sound)]
        sites = ["detokenizer", "grammar 'faulty' fill_bitmask", "drafter 'faulty'", *WORKER_SITES]
        for site in sites:
            marker = "<worker-fault>" if site == "rejection_sampler" else FAULT_STOP
            if site in WORKER_SITES:
                llm.engine.executor.collective_rpc(inject_worker_fault, args=(site, marker))
            os.environ["FAULT_SITE"] = site
            poisoned = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "stop": [marker], **reach.get(site, {})})
            outs = llm.generate(PROMPTS[:3] + ["The dog"], sound + [poisoned])
            llm.engine.executor.collective_rpc(clear_worker_faults)
            os.environ.pop("FAULT_SITE")
            bad = outs[-1]
            named = {"detokenizer": "stop checker (detokenizer", "rejection_sampler": "rejection sampler on worker",
                     "grammar 'faulty' fill_bitmask": "fill_bitmask"}.get(
                site, site if site not in WORKER_SITES else f"worker's {site}")
            results.append({"site": site, "poisoned_failed": bad.outputs[0].finish_reason == "abort" and bool(bad.error)
                            and named in bad.error, "error": bad.error,
                            "others_equal": [o.outputs[0].token_ids for o in outs[:3]] == baseline})
        llm.engine.check_health()
        llm.engine.shutdown()
    emit("sites", results=results)
    bad_sites = [r["site"] for r in results if not (r["poisoned_failed"] and r["others_equal"])]
    outcome(RuntimeError(f"sites that failed more than their request: {bad_sites}") if bad_sites else None,
            4 * len(results), sum(3 + (not r["poisoned_failed"]) for r in results),
            summary=f"{len(results)} sites ({', '.join(r['site'] for r in results)}): each failed only its poisoned "
                    "request (error naming the site), the other 3 equal a run without faults; engine healthy after")


def forward_fault(row: dict[str, Any]) -> None:
    """``worker_oom``: the rank's next forward raises an allocator's out-of-memory error;
    ``worker_hang``: the rank's next forward sleeps (its process still beats)."""
    from framework import LLM
    from framework.testing.fault_injection import hang_worker, simulate_worker_oom

    llm = LLM(**engine_kwargs(row))
    llm.generate(PROMPTS[:1], long_params())
    rank = row.get("tp", 1) - 1
    if row["kind"] == "worker_oom":
        llm.engine.executor.collective_rpc(simulate_worker_oom, args=(rank,))
    else:
        llm.engine.executor.collective_rpc(hang_worker, args=(600.0, rank))
    emit("phase", phase="step", at=time.time())
    try:
        llm.generate(PROMPTS, long_params())
    except Exception as exc:  # noqa: BLE001 - what the user sees
        outcome(exc, len(PROMPTS), 0)
    outcome(None, len(PROMPTS), len(PROMPTS))


def hook_hang(row: dict[str, Any]) -> None:
    """A lifecycle hook that never returns (``on_step_end`` on the driver) under a server's engine loop: the
    watchdog (``engine.watchdog_timeout_s``) fails every request."""
    from framework import LLM, registry
    from framework.engine.async_llm import AsyncLLM

    class Hanging:
        steps = 0

        @hookimpl
        def on_step_end(self, stats: Any) -> None:
            self.steps += 1
            if self.steps == 3:
                emit("phase", phase="step", at=time.time())
                time.sleep(3600)

    with registry.registered(Hanging(), name="hanging-observer"):
        llm = LLM(**engine_kwargs(row))
        dead: list[BaseException] = []
        engine = AsyncLLM(llm.engine, on_dead=dead.append)

        async def one(prompt: str) -> bool:
            try:
                async for _ in engine.generate(prompt, long_params()):
                    pass
            except Exception:  # noqa: BLE001 - counted as failed
                return False
            return True

        async def main() -> list[bool]:
            return await asyncio.gather(*[one(p) for p in PROMPTS])

        served = asyncio.run(main())
        end = time.monotonic() + 5  # on_dead runs on the client thread after the streams failed: wait for it
        while not dead and time.monotonic() < end:
            time.sleep(0.05)
    outcome(dead[0] if dead else None, len(PROMPTS), sum(served),
            server_exit="the server answers 503 and exits 1" if dead else None)


KINDS = {"rank_signal": rank_fault, "driver_kill": rank_fault, "group_kill": rank_fault,
         "request_faults": request_faults, "worker_oom": forward_fault, "worker_hang": forward_fault,
         "hook_hang": hook_hang}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    emit("pid", pid=os.getpid())
    KINDS[spec["kind"]](spec)
