"""Fault-injection matrix of the runtime (issue 44): what a user sees when a part fails, which requests are
lost, and what is left behind, for every executor.

Each row runs in a child process (``_fault_scenarios.py``; servers through ``run.py mode=serve``) on
stories260K: a SIGKILL or SIGSTOP of one rank while it loads, compiles, runs a step or idles (``mp`` at
TP=1 and TP=2, ``ray`` at TP=2 when installed); a SIGKILL of the driver mid-run; SIGTERM / SIGINT of a
server mid-stream (``uniproc``, ``mp`` TP=2); an exception at every per-request site of the driver and
the worker (``uniproc``, ``mp`` TP=2); a worker that runs out of memory (simulated: the allocator's
error) and one that hangs inside a step; a lifecycle hook that hangs under a server's engine loop. While
a row runs, the matrix samples the child's process tree and the ``/dev/shm`` segments those processes
map; afterwards every one of those processes must be gone and every segment unlinked (and a server's
port free) within ``LEFTOVER_WAIT_S``. Prints the table (Markdown) and writes JSON (``--json-out``);
exit status 1 when a row fails.

    .venv/bin/python experiments/fault_matrix.py                      # every row (about 25 minutes on 2 cores)
    .venv/bin/python experiments/fault_matrix.py --only mp2 --quick   # rows whose label contains "mp2"; no compile rows
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = REPO / "experiments" / "_fault_scenarios.py"
LEFTOVER_WAIT_S = 15.0  # seconds every process of a row has to exit and every segment to go
#: Ray's own node agents (DashboardAgent, RuntimeEnvAgent) outlive a SIGKILLed driver by ~60 s before they
#: exit by themselves (the ranks, Ray actors, go within seconds); its driver-kill row waits this long
RAY_AGENTS_WAIT_S = 90.0
ROW_TIMEOUT_S = 400.0  # a row still running after this is killed and fails


@dataclass
class RowResult:
    """One row of the table."""

    label: str  # e.g. "mp2 SIGKILL rank during step"
    user_sees: str = ""  # the error (first line) or the server's answers
    exit_code: int | None = None  # of the driver process (the user's script or server)
    detect_s: float | None = None  # fault -> the user told (driver kill: -> every rank gone), seconds
    num_requests: int = 0  # in flight when the fault struck
    failed: int = 0  # of those, failed with an error
    served: int = 0  # of those, served
    leftover_pids: list[int] = field(default_factory=list)
    leftover_shm: list[str] = field(default_factory=list)
    port_free: bool | None = None
    passed: bool = False
    why: str = ""  # the failed check


def rows(executors: list[str], quick: bool) -> list[dict[str, Any]]:
    """Every row of the matrix for these executors (``uniproc``, ``mp1``, ``mp2``, ``ray2``)."""
    out: list[dict[str, Any]] = []
    specs = {"uniproc": ("uniproc", 1), "mp1": ("mp", 1), "mp2": ("mp", 2), "ray2": ("ray", 2)}
    for name in executors:
        executor, tp = specs[name]
        base = {"executor": executor, "tp": tp, "name": name}
        if name != "uniproc":
            for sig in ("SIGKILL", "SIGSTOP"):
                for phase in ("load", "step", "idle") + (() if quick else ("compile",)):
                    out.append({**base, "kind": "rank_signal", "signal": sig, "phase": phase,
                                "label": f"{name} {sig} rank during {phase}"})
        if name in ("mp2", "ray2", "uniproc"):
            out.append({**base, "kind": "driver_kill", "phase": "step", "label": f"{name} SIGKILL driver during step"})
        if name in ("uniproc", "mp2"):
            out.append({**base, "kind": "request_faults", "label": f"{name} exception at every per-request site"})
            out.append({**base, "kind": "worker_oom", "label": f"{name} worker out of memory (simulated) in a step"})
            for sig in ("SIGTERM", "SIGINT"):
                out.append({**base, "kind": "server_signal", "signal": sig, "label": f"{name} server {sig} mid-stream"})
            out.append({**base, "kind": "hook_hang", "engine": {"watchdog_timeout_s": 20},
                        "label": f"{name} lifecycle hook hangs (server, watchdog 20 s)"})
        if name in ("mp2", "ray2"):
            out.append({**base, "kind": "worker_hang", "label": f"{name} rank hangs in a step (beating)"})
    return out


class _Tree:
    """Samples a process tree (pids) and the ``/dev/shm`` segments its processes map, every 0.1 s."""

    def __init__(self, root: int) -> None:
        self.root, self.pids, self.shm = root, {root}, set()
        self.gone_at: float | None = None
        self.names: dict[int, str] = {}  # cmdline of processes still alive at the end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            with contextlib.suppress(psutil.Error):
                self.pids |= {p.pid for p in psutil.Process(self.root).children(recursive=True)}
            for pid in list(self.pids):
                with contextlib.suppress(OSError):
                    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                        if "/dev/shm/" in line:
                            self.shm.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
            self._stop.wait(0.1)

    def ranks(self) -> list[int]:
        """Rank processes seen so far: ``mp`` workers (spawned) or Ray ``RankActor`` workers."""
        import psutil

        found = []
        for pid in sorted(self.pids - {self.root}):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(psutil.Process(pid).cmdline())
                if ("spawn_main" in cmd and "resource_tracker" not in cmd) or "RankActor" in cmd:
                    found.append(pid)
        return found

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def leftovers(self, wait_s: float = LEFTOVER_WAIT_S) -> tuple[list[int], list[str]]:
        """Processes of the tree still alive and segments still named, after up to ``wait_s``
        (:attr:`gone_at`: ``time.time()`` when none was left)."""
        import psutil

        end = time.monotonic() + wait_s
        while True:
            alive = []
            for pid in sorted(self.pids):
                with contextlib.suppress(psutil.Error):
                    process = psutil.Process(pid)
                    if process.status() != psutil.STATUS_ZOMBIE:
                        alive.append(pid)
                        self.names[pid] = " ".join(process.cmdline())[:80]
            shm = sorted(n for n in self.shm if (Path("/dev/shm") / n).exists())
            if not alive and not shm:
                self.gone_at = time.time()
                return alive, shm
            if time.monotonic() > end:
                return alive, shm
            time.sleep(0.2)


def _events(proc: subprocess.Popen) -> queue.Queue:
    """The child's ``EVENT`` lines as dicts, on a queue (``None`` at end of output)."""
    q: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("EVENT "):
                q.put(json.loads(line[6:]))
        q.put(None)

    threading.Thread(target=read, daemon=True).start()
    return q


def _next(q: queue.Queue, kind: str, timeout_s: float) -> dict[str, Any] | None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            event = q.get(timeout=max(end - time.monotonic(), 0.01))
        except queue.Empty:
            return None
        if event is None or event["event"] == kind:
            return event
    return None


def run_row(row: dict[str, Any], log_dir: Path) -> RowResult:
    """Run one row; checks in :func:`judge`."""
    if row["kind"] == "server_signal":
        return _server_row(row, log_dir)
    result = RowResult(row["label"])
    log = open(log_dir / (row["label"].replace(" ", "_") + ".log"), "w")
    proc = subprocess.Popen([sys.executable, str(SCENARIOS), json.dumps(row)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=log, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    tree, q = _Tree(proc.pid), _events(proc)
    t_fault = None
    try:
        phase = _next(q, "phase", ROW_TIMEOUT_S)
        if row["kind"] == "rank_signal" and phase is not None:
            t_fault = _strike_rank(row, tree)
        elif row["kind"] == "driver_kill" and phase is not None:
            time.sleep(0.5)
            t_fault = time.time()
            os.kill(proc.pid, signal.SIGKILL)
        elif phase is not None:
            t_fault = phase["at"]
        out = _next(q, "outcome", ROW_TIMEOUT_S) if row["kind"] != "driver_kill" else None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
            result.why = "the driver did not exit"
        result.exit_code = proc.wait(30)
        if out is not None:
            result.user_sees = out["error"] or out.get("server_exit") or out.get("summary") or "served"
            result.num_requests, result.failed, result.served = out["num_requests"], out["failed"], out["served"]
            result.detect_s = None if t_fault is None else round(out["at"] - t_fault, 2)
    finally:
        tree.stop()
        wait_s = RAY_AGENTS_WAIT_S if row["kind"] == "driver_kill" and row["executor"] == "ray" else LEFTOVER_WAIT_S
        result.leftover_pids, result.leftover_shm = tree.leftovers(wait_s)
        if result.leftover_pids:
            print(f"{row['label']}: left behind {[tree.names.get(p) for p in result.leftover_pids]}", file=sys.stderr)
        for pid in result.leftover_pids:  # never leave them running
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        log.close()
    if row["kind"] == "driver_kill":  # the requests in flight die with their driver
        result.num_requests = result.failed = 4
        result.user_sees = "the driver dies of SIGKILL; its ranks exit by themselves (detect: until the last is gone)"
        result.detect_s = None if tree.gone_at is None or t_fault is None else round(tree.gone_at - t_fault, 2)
    return judge(row, result)


def _strike_rank(row: dict[str, Any], tree: _Tree) -> float:
    """Signal one rank once it exists (load: as soon as it appears, mid-import/-load); returns when."""
    end = time.monotonic() + 120
    while not tree.ranks() and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep({"load": 1.0, "compile": 5.0}.get(row["phase"], 0.5))
    target = tree.ranks()[-1]
    os.kill(target, getattr(signal, row["signal"]))
    return time.time()


def _server_row(row: dict[str, Any], log_dir: Path) -> RowResult:
    """``run.py mode=serve``: a streaming request, then SIGTERM/SIGINT: the stream must end with an abort
    chunk and ``[DONE]``, the server exit 0, its port be free and nothing be left."""
    import httpx

    result = RowResult(row["label"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log = open(log_dir / (row["label"].replace(" ", "_") + ".log"), "w")
    proc = subprocess.Popen([sys.executable, "run.py", "mode=serve", "model=stories260K", "engine.compile=false",
                             f"parallel.tensor_parallel_size={row['tp']}", f"executor={row['executor']}",
                             f"server.port={port}", "tracker=none", "server.log_level=warning",
                             f"hydra.run.dir={tempfile.mkdtemp(prefix='fault_matrix_')}"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    tree, lines = _Tree(proc.pid), []
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", base + "/v1/completions", json=body,
                                                                    timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        first.wait(60)
        time.sleep(0.3)
        t_fault = time.monotonic()
        proc.send_signal(getattr(signal, row["signal"]))
        result.exit_code = proc.wait(60)
        result.detect_s = round(time.monotonic() - t_fault, 2)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        tree.stop()
        result.leftover_pids, result.leftover_shm = tree.leftovers()
        log.close()
    aborted = len(lines) >= 2 and lines[-1] == "data: [DONE]" and '"finish_reason":"abort"' in lines[-2].replace(" ", "")
    result.num_requests, result.failed = 1, 1 if aborted else 0
    result.user_sees = ("the stream ends with finish_reason=abort and [DONE]; exit 0" if aborted
                        else f"stream ended with {lines[-2:]}")
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            result.port_free = True
        except OSError:
            result.port_free = False
    return judge(row, result)


def judge(row: dict[str, Any], r: RowResult) -> RowResult:
    """The row's checks: the error a user should see, detection bounds, lost requests, nothing left."""
    kind, problems = row["kind"], []
    if r.leftover_pids or r.leftover_shm or r.port_free is False:
        problems.append(f"left behind: pids {r.leftover_pids}, segments {r.leftover_shm}, port free {r.port_free}")
    bound = {"SIGKILL": 5.0, "SIGSTOP": 10.0 + 5.0}.get(row.get("signal", ""), None)
    if kind == "rank_signal":
        if not any(text in r.user_sees for text in ("lost a worker", "failed to start", "could not start")):
            problems.append("no engine-dead / start-up error")
        if r.detect_s is None or r.detect_s > bound:
            problems.append(f"detected after {r.detect_s} s (bound {bound} s)")
        if row["phase"] != "idle" and r.exit_code != 1:
            problems.append(f"exit code {r.exit_code}")
    elif kind == "request_faults" and (r.exit_code != 0 or not r.num_requests or r.failed != r.num_requests // 4):
        problems.append("a site failed more than its request (or none ran)")
    elif kind == "worker_oom" and "can't allocate memory" not in r.user_sees:
        problems.append("the out-of-memory error is not shown")
    elif kind == "worker_hang" and (r.detect_s is None or r.detect_s > 30 + 10):
        problems.append(f"hang detected after {r.detect_s} s (step deadline floor 30 s + 10)")
    elif kind == "hook_hang" and (r.detect_s is None or r.detect_s > 20 + 5 or "watchdog" not in r.user_sees):
        problems.append(f"hang detected after {r.detect_s} s (watchdog 20 s + 5)")
    elif kind == "server_signal" and (r.exit_code != 0 or not r.failed):
        problems.append("the server did not end the stream with an abort and exit 0")
    if r.why:
        problems.append(r.why)
    r.passed, r.why = not problems, "; ".join(problems)
    return r


def render(results: list[RowResult]) -> str:
    """The Markdown table of ``docs/results.md``."""
    head = ("| row | what the user sees | exit | detect (s) | requests in flight / failed / served | "
            "left (procs, segments, port) | pass |\n|---|---|---|---|---|---|---|")
    body = []
    for r in results:
        left = "none" if not (r.leftover_pids or r.leftover_shm or r.port_free is False) else \
            f"{len(r.leftover_pids)} procs, {len(r.leftover_shm)} segs, port {'free' if r.port_free else 'held'}"
        body.append(f"| {r.label} | {r.user_sees[:150]} | {r.exit_code} | "
                    f"{'-' if r.detect_s is None else f'{r.detect_s:.1f}'} | {r.num_requests} / {r.failed} / "
                    f"{r.served} | {left} | {'yes' if r.passed else 'NO: ' + r.why} |")
    return "\n".join([head, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executors", default="uniproc,mp1,mp2,ray2", help="comma-separated: uniproc, mp1, mp2, ray2")
    p.add_argument("--only", default="", help="run only rows whose label contains this text")
    p.add_argument("--quick", action="store_true", help="leave out the compile-warm-up rows")
    p.add_argument("--json-out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    executors = [e for e in args.executors.split(",") if e != "ray2" or importlib.util.find_spec("ray")]
    selected = [r for r in rows(executors, args.quick) if args.only in r["label"]]
    log_dir = Path(tempfile.mkdtemp(prefix="fault_matrix_logs_"))
    results = []
    for row in selected:
        t0 = time.monotonic()
        results.append(run_row(row, log_dir))
        print(f"{row['label']}: {'pass' if results[-1].passed else 'FAIL ' + results[-1].why} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(render(results))
    print(f"\nlogs: {log_dir}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
