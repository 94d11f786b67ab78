"""Soak of ``servelab serve`` under faults (issue 34), on loopback only, bounded in time.

Starts the server as a child process (``--model``, extra Hydra overrides after ``--``) with the deliberately faulty
plugins of ``framework.testing.faulty_plugins`` registered: ``spec_decode=faulty`` (its batched ``propose`` raises
whenever a poisoned request is in the batch) and an observer whose lifecycle hooks raise every 25th call. Then
``--duration-s`` seconds of mixed traffic from ``--concurrency`` clients plus a burst of ``--burst-size`` requests every
``--burst-every-s`` (above ``max_num_seqs``): streaming and not, random sampling parameters, a share of structured
requests, of poisoned requests (``stop: [FAULT_STOP]``), of invalid ones, and clients that abort before the first
token or disconnect mid-stream (``_soak_traffic.py``). Afterwards it checks:

* every request was answered exactly once: finished (one finish reason per stream, one ``[DONE]``), aborted by its
  client, failed (exactly the poisoned ones: 500 / an error event naming the drafter) or refused (4xx, exactly the
  invalid ones); nothing else (no 503, no other 5xx, no transport error);
* 0 KV blocks leaked: ``/metrics`` shows no running or waiting request and KV usage 0 once the traffic stops;
* ``/metrics`` counters agree with what clients saw (finished + aborted requests, generated tokens);
* resident memory of the server is flat after warm-up: live memory grows less than ``MAX_GROWTH_MIB_PER_1K`` per
  1,000 requests between the first third of the run and its end. "Live" is the resident size right after
  ``malloc_trim(0)`` (the driver sends the server SIGUSR1 at both points): the engine's ``tune_malloc`` keeps up to
  1 GiB of freed heap mapped for reuse, so raw RSS rises in steps whenever a batch needs more than any before it
  (+200 MiB in one step has been seen) and is not a leak measure; it is reported as well;
* ``/health`` is 200 and a plain request still completes; SIGTERM then exits 0.

Prints a table (requests, outcomes, leaks, memory growth, p50/p99 TTFT and e2e latency) and writes JSON
(``--json-out``). Exit status 1 when a check fails. The 10-minute run of the issue::

    .venv/bin/python -m experiments.serving.soak_serving --model smollm2 --duration-s 600
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.common import REPO_ROOT
from experiments.serving._soak_traffic import check_run, render_table, run_traffic

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TRIM_ACK_ENV = "SOAK_TRIM_ACK"  # file the server writes its heap-trim count to
TRIM_WAIT_S = 10.0  # longest wait for a trim's acknowledgement
_TRIMS = [0]  # the server's trims so far
HOOK_FAULT_EVERY = 25  # the faulty observer raises on every 25th call of each lifecycle hook
MAX_GROWTH_MIB_PER_1K = 16.0  # resident-memory growth per 1,000 requests above which the soak fails


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Options, and the Hydra overrides for the server (everything after ``--``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="stories260K", help="servelab model alias or folder")
    p.add_argument("--duration-s", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--concurrency", type=int, default=12, help="clients sending back to back")
    p.add_argument("--burst-every-s", type=float, default=15.0, help="seconds between bursts")
    p.add_argument("--burst-size", type=int, default=48, help="requests fired at once per burst")
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens a request asks for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="result JSON (default experiments/results/soak_<model>.json)")
    p.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)  # internal: be the server
    return p.parse_args(argv), overrides


def serve_child(overrides: list[str]) -> int:
    """The server process: ``servelab serve`` with the faulty plugins registered."""
    import torch

    from framework.entrypoints.cli import main
    from framework.worker import kv_memory

    signal.signal(signal.SIGUSR1, _malloc_trim)  # the driver measures live memory: freed heap back to the OS first
    # the KV cache resident from the start: its pages otherwise commit as blocks are first used, a rise in RSS over
    # the soak's first thousands of requests that is not a leak
    kv_memory.zeros_on_demand = lambda shape, dtype, device="cpu": torch.zeros(shape, dtype=dtype, device=device)
    register_faulty_plugins()
    return main(["serve", *overrides]) or 0


def register_faulty_plugins() -> None:
    """The faulty drafter/grammar/hook plugins of ``framework.testing.faulty_plugins``, in this process."""
    from framework import registry
    from framework.testing import faulty_plugins

    registry.plugin_manager().register(faulty_plugins, name="soak-faulty-plugins")
    registry.plugin_manager().register(faulty_plugins.FaultyObserver(every=HOOK_FAULT_EVERY), name="soak-faulty-hooks")


def _malloc_trim(signum: int, frame: Any) -> None:
    """SIGUSR1 in the server: glibc's ``malloc_trim(0)`` returns every arena's free pages to the OS; then the trim
    count goes to ``$SOAK_TRIM_ACK`` (the driver waits for it)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    _TRIMS[0] += 1
    ack = os.environ.get(TRIM_ACK_ENV)
    if ack:
        with contextlib.suppress(OSError):
            Path(ack + ".tmp").write_text(str(_TRIMS[0]))
            os.replace(ack + ".tmp", ack)


def _trims(ack: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(ack.read_text())
    return 0


def live_rss_mib(pid: int, ack: Path) -> float:
    """Resident memory of the soak's server after it trimmed its heap (SIGUSR1 and its acknowledgement in ``ack``;
    at most :data:`TRIM_WAIT_S` seconds), MiB."""
    done = _trims(ack)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + TRIM_WAIT_S  # the handler runs between the server's bytecodes
    while _trims(ack) == done and time.monotonic() < deadline:
        time.sleep(0.02)
    return rss_mib(pid)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, overrides: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start the child server and wait (up to 10 min: SmolLM2 may convert its weights once) until healthy."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "experiments.serving.soak_serving", "--serve-child", "--", f"model={model}",
           f"server.port={port}", "server.log_level=warning", "tracker=none", "spec_decode=faulty",
           f"hydra.run.dir={tempfile.mkdtemp(prefix='soak_run_')}", *overrides]
    env = {**os.environ, TRIM_ACK_ENV: str(log_path.with_suffix(".trims"))}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the server did not become healthy in 600 s; see {log_path}")
        time.sleep(0.5)


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` (``VmRSS``), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metrics(base: str) -> dict[str, float]:
    """``/metrics`` as ``name[finished_reason] -> value`` (summed over other labels)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
            values[key] = values.get(key, 0.0) + s.value
    return values


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the soak; returns the result record (also written as JSON). Exits 1 (SystemExit) when a check fails
    and ``argv`` came from the command line."""
    args, overrides = parse_args(argv)
    if args.serve_child:
        sys.exit(serve_child(overrides))
    out = Path(args.json_out or REPO_ROOT / "experiments" / "results" / f"soak_{Path(args.model).name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".server.log")
    proc, base = start_server(args.model, overrides, log_path)
    ack = log_path.with_suffix(".trims")
    try:
        before = metrics(base)
        samples: list[tuple[float, int, float]] = []  # (seconds, requests done, RSS MiB)
        live: list[tuple[int, float]] = []  # (requests done, RSS MiB after malloc_trim) at a third and at the end
        t_start = time.monotonic()

        def sample(done: int) -> None:
            samples.append((time.monotonic(), done, rss_mib(proc.pid)))
            if not live and time.monotonic() - t_start >= args.duration_s / 3:
                live.append((done, live_rss_mib(proc.pid, ack)))  # pauses this client loop: bursts wait too

        records = asyncio.run(run_traffic(base, args, sample))
        live.append((len(records), live_rss_mib(proc.pid, ack)))
        result = check_run(base, records, before, samples, MAX_GROWTH_MIB_PER_1K, metrics, live)
        proc.send_signal(signal.SIGTERM)
        result["checks"]["sigterm_exit_0"] = proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        ack.unlink(missing_ok=True)
    result.update(model=args.model, duration_s=args.duration_s, concurrency=args.concurrency,
                  burst_size=args.burst_size, server_overrides=overrides,
                  command=" ".join([".venv/bin/python", "-m", "experiments.serving.soak_serving",
                                     *(argv or sys.argv[1:])]))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(render_table(result))
    print(f"JSON: {out}")
    result["ok"] = all(result["checks"].values())
    if argv is None and not result["ok"]:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()


if __name__ == "__mp_main__":  # the server's engine-core process (spawned from the serve child) needs them too
    register_faulty_plugins()
