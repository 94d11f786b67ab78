"""Fault-injection matrix of the runtime (issue 44): what a user sees when a part fails, which requests are
lost, and what is left behind, for every executor.

Each row runs in a child process of its own session (``_fault_scenarios.py``; servers through ``run.py
mode=serve``) on stories260K: a SIGKILL or SIGSTOP of one rank while it loads, compiles, runs a step or
idles (``mp`` at TP=1 and TP=2, ``ray`` at TP=2 when installed); a SIGKILL of the driver, and of the whole
process group (the OOM killer, a container's stop: ``multiprocessing``'s resource tracker dies too), in
the same phases (``mp`` and ``ray`` at TP=2, two ``mp`` data-parallel replicas mid-step); SIGTERM / SIGINT
of a server mid-stream (``uniproc``, ``mp`` TP=2); a SIGKILL of a server's API process and of its whole
group mid-stream, and a SIGTERM while its engine core still starts (``mp`` TP=2, two data-parallel
cores); an exception at every per-request site of the driver and the worker (``uniproc``, ``mp`` TP=2); a
worker that runs out of memory (simulated: the allocator's error) and one that hangs inside a step; a
lifecycle hook that hangs under a server's engine loop.

What is left is checked as a user would: the whole of ``/dev/shm`` is listed before the row starts and after
it ends, and every name that appeared and that no live process uses is a leftover (names a concurrent
program holds are not the row's: ``framework.testing.leftovers``); every process the row's tree ever had
(sampled every 0.1 s, by pid) must be gone, and a server's port free, within ``LEFTOVER_WAIT_S``. A
process-group kill, a driver kill and a server kill must also leave no process after
``GONE_WITHIN_S``. ``--cpus 0`` runs every row under ``taskset -c 0`` (a machine slower than the
developer's: windows between a name's creation and its removal open wider). Prints the table
(Markdown) and writes JSON (``--json-out``); exit status 1 when a row fails.

    .venv/bin/python -m experiments.faults.fault_matrix                      # every row (about an hour on 2 cores)
    .venv/bin/python -m experiments.faults.fault_matrix --only mp2 --quick   # rows whose label contains "mp2"; no compile rows
    .venv/bin/python -m experiments.faults.fault_matrix --only group --cpus 0  # the group kills, on one core
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import shutil
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

from experiments.common import REPO_ROOT, markdown_table
from framework.testing.leftovers import live_pids, new_shm_names, shm_snapshot

SCENARIOS = "experiments.faults._fault_scenarios"  # the driver side of a row, run as a module
LEFTOVER_WAIT_S = 15.0  # seconds every process of a row has to exit and every segment to go
GONE_WITHIN_S = 10.0  # after a driver, group or server kill: seconds until no process of the run is left
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
    leftover_shm: list[str] = field(default_factory=list)  # /dev/shm names new since the row started, unused
    port_free: bool | None = None
    passed: bool = False
    why: str = ""  # the failed check


SPECS = {"uniproc": ("uniproc", 1, 1), "mp1": ("mp", 1, 1), "mp2": ("mp", 2, 1), "ray2": ("ray", 2, 1),
         "dp2": ("mp", 1, 2)}  # name -> (executor, tensor_parallel_size, data_parallel_size)


def rows(executors: list[str], quick: bool) -> list[dict[str, Any]]:
    """Every row of the matrix for these executors (``uniproc``, ``mp1``, ``mp2``, ``ray2``, ``dp2``)."""
    out: list[dict[str, Any]] = []
    phases = ("load", "step", "idle") + (() if quick else ("compile",))
    for name in executors:
        executor, tp, dp = SPECS[name]
        base = {"executor": executor, "tp": tp, "dp": dp, "name": name}
        if name in ("mp1", "mp2", "ray2"):
            for sig in ("SIGKILL", "SIGSTOP"):
                for phase in phases:
                    out.append({**base, "kind": "rank_signal", "signal": sig, "phase": phase,
                                "label": f"{name} {sig} rank during {phase}"})
        if name == "uniproc":
            out.append({**base, "kind": "driver_kill", "phase": "step", "label": f"{name} SIGKILL driver during step"})
        if name in ("mp2", "ray2", "dp2"):
            for kind, who in (("driver_kill", "driver"), ("group_kill", "group")):
                for phase in (phases if name != "dp2" else ("step",)):
                    out.append({**base, "kind": kind, "phase": phase, "label": f"{name} SIGKILL {who} during {phase}"})
        if name in ("uniproc", "mp2"):
            out.append({**base, "kind": "request_faults", "label": f"{name} exception at every per-request site"})
            out.append({**base, "kind": "worker_oom", "label": f"{name} worker out of memory (simulated) in a step"})
            for sig in ("SIGTERM", "SIGINT"):
                out.append({**base, "kind": "server_signal", "signal": sig, "phase": "stream", "target": "api",
                            "label": f"{name} server {sig} mid-stream"})
            out.append({**base, "kind": "hook_hang", "engine": {"watchdog_timeout_s": 20},
                        "label": f"{name} lifecycle hook hangs (server, watchdog 20 s)"})
        if name in ("mp2", "dp2"):
            for target in ("api", "group"):
                out.append({**base, "kind": "server_signal", "signal": "SIGKILL", "phase": "stream", "target": target,
                            "label": f"{name} server SIGKILL {'API process' if target == 'api' else 'group'} "
                                     "mid-stream"})
            out.append({**base, "kind": "server_signal", "signal": "SIGTERM", "phase": "startup", "target": "api",
                        "label": f"{name} server SIGTERM while its core starts"})
        if name in ("mp2", "ray2"):
            out.append({**base, "kind": "worker_hang", "label": f"{name} rank hangs in a step (beating)"})
    return out


class _Tree:
    """A row's process tree, sampled every 0.1 s (pids), and the ``/dev/shm`` names before the row started."""

    def __init__(self, root: int, shm_before: frozenset[str], serving: bool = False) -> None:
        self.root, self.pids, self.shm_before, self.serving = root, {root}, shm_before, serving
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
            self._stop.wait(0.1)

    def ranks(self) -> list[int]:
        """Rank processes seen so far: ``mp`` workers (named ``servelab-rank<r>``, forked or spawned) or Ray
        ``RankActor`` workers (not the resource tracker, the fork server or a server's ``servelab-core`` cores)."""
        import psutil

        found = []
        for pid in sorted(self.pids - {self.root}):
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(pid)
                if process.name().startswith("servelab-rank") or "RankActor" in " ".join(process.cmdline()):
                    found.append(pid)
        return found

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def leftovers(self, wait_s: float = LEFTOVER_WAIT_S) -> tuple[list[int], list[str]]:
        """Processes of the tree still alive and ``/dev/shm`` names the row left (new since it started, used by
        no live process), after up to ``wait_s`` (:attr:`gone_at`: ``time.time()`` when no process was left)."""
        import psutil

        end = time.monotonic() + wait_s
        while True:
            alive = live_pids(self.pids)
            if not alive and self.gone_at is None:
                self.gone_at = time.time()
            shm = new_shm_names(self.shm_before)
            if (not alive and not shm) or time.monotonic() > end:
                break
            time.sleep(0.1)
        for pid in alive:
            with contextlib.suppress(psutil.Error):
                self.names[pid] = " ".join(psutil.Process(pid).cmdline())[:80]
        return alive, shm


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


KILLS = ("driver_kill", "group_kill")  # rows whose fault ends the run's driver: nothing is reported, only left


def _command(cmd: list[str], cpus: str | None) -> list[str]:
    """``cmd``, under ``taskset -c cpus`` when given (a slower machine: every process of the row on those CPUs)."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def _env(row: dict[str, Any]) -> dict[str, str]:
    """The row's environment: offline hub; a compile row gets an empty inductor cache, so that it compiles for
    as long as a first run does (a cached compile ends before the fault strikes)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if row.get("phase") == "compile" or row.get("phase") == "startup":
        env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fault_matrix_inductor_")
    return env


def run_row(row: dict[str, Any], log_dir: Path, cpus: str | None = None) -> RowResult:
    """Run one row (under ``taskset -c cpus`` when given); checks in :func:`judge`."""
    if row["kind"] == "server_signal":
        return _server_row(row, log_dir, cpus)
    result = RowResult(row["label"])
    log = open(log_dir / (row["label"].replace(" ", "_") + ".log"), "w")
    env, before = _env(row), shm_snapshot()
    proc = subprocess.Popen(_command([sys.executable, "-m", SCENARIOS, json.dumps(row)], cpus), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    tree, q, t_fault, kill = _Tree(proc.pid, before), _events(proc), None, row["kind"] in KILLS
    try:
        phase = _next(q, "phase", ROW_TIMEOUT_S)
        if phase is not None and (row["kind"] == "rank_signal" or kill):
            t_fault = _strike(row, tree, proc.pid)
        elif phase is not None:
            t_fault = phase["at"]
        out = None if kill else _next(q, "outcome", ROW_TIMEOUT_S)
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
        result.leftover_pids, result.leftover_shm = tree.leftovers(LEFTOVER_WAIT_S)
        _reap(row, tree, result, env)
        log.close()
    if kill:  # the requests in flight die with their driver
        result.num_requests = result.failed = 4 if row["phase"] == "step" else 0
        result.user_sees = (f"the {'driver' if row['kind'] == 'driver_kill' else 'process group'} dies of SIGKILL; "
                            "every process of the run exits by itself (detect: until the last is gone)")
        result.detect_s = None if tree.gone_at is None or t_fault is None else round(tree.gone_at - t_fault, 2)
    return judge(row, result)


def _reap(row: dict[str, Any], tree: _Tree, result: RowResult, env: dict[str, str]) -> None:
    """Name and kill what a row left running (never leave it to the next row); drop a compile row's cache."""
    if result.leftover_pids:
        print(f"{row['label']}: left behind {[tree.names.get(p) for p in result.leftover_pids]}", file=sys.stderr)
    for pid in result.leftover_pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if env.get("TORCHINDUCTOR_CACHE_DIR", "").startswith(tempfile.gettempdir() + "/fault_matrix_inductor_"):
        shutil.rmtree(env["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def _strike(row: dict[str, Any], tree: _Tree, root: int) -> float:
    """The row's fault, once its ranks exist (load: as soon as they appear, mid-import/-load): a signal to the
    last rank, a SIGKILL of the driver (``root``) or of its whole process group; returns when (``time.time()``)."""
    if row["executor"] != "uniproc":
        end = time.monotonic() + 120
        while not tree.ranks() and time.monotonic() < end:
            time.sleep(0.05)
    time.sleep({"load": 1.0, "compile": 5.0}.get(row["phase"], 0.5))
    if row["kind"] == "group_kill":
        os.killpg(root, signal.SIGKILL)
    elif row["kind"] == "driver_kill":
        os.kill(root, signal.SIGKILL)
    else:
        os.kill(tree.ranks()[-1], getattr(signal, row["signal"]))
    return time.time()


def _server_row(row: dict[str, Any], log_dir: Path, cpus: str | None = None) -> RowResult:
    """``run.py mode=serve``. Phase ``stream``: a streaming request, then the signal: SIGTERM/SIGINT must end the
    stream with an abort chunk and ``[DONE]`` and the server exit 0; a SIGKILL (of the API process, or of its
    whole group) breaks the stream. Phase ``startup``: SIGTERM once the engine core's ranks exist (loading,
    compiling with an empty cache). In every case the port must be free and nothing be left."""
    result = RowResult(row["label"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    log = open(log_dir / (row["label"].replace(" ", "_") + ".log"), "w")
    startup = row["phase"] == "startup"
    env, before = _env(row), shm_snapshot()
    cmd = [sys.executable, "run.py", "mode=serve", "model=stories260K", f"engine.compile={str(startup).lower()}",
           f"parallel.tensor_parallel_size={row['tp']}", f"parallel.data_parallel_size={row.get('dp', 1)}",
           f"executor={row['executor']}", f"server.port={port}", "tracker=none", "server.log_level=warning",
           f"hydra.run.dir={tempfile.mkdtemp(prefix='fault_matrix_')}"]
    proc = subprocess.Popen(_command(cmd, cpus), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    tree, lines, reader, t_fault = _Tree(proc.pid, before, serving=True), [], None, None
    try:
        if startup:
            end = time.monotonic() + 120
            while not tree.ranks() and time.monotonic() < end and proc.poll() is None:
                time.sleep(0.05)
            time.sleep(2.0)
        else:
            reader = _stream_when_healthy(proc, base, lines)
        t_fault = time.time()
        if row["target"] == "group":
            os.killpg(proc.pid, getattr(signal, row["signal"]))
        else:
            proc.send_signal(getattr(signal, row["signal"]))
        result.exit_code = proc.wait(60)
        if reader is not None:
            reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        tree.stop()
        result.leftover_pids, result.leftover_shm = tree.leftovers()
        _reap(row, tree, result, env)
        log.close()
    result.detect_s = None if tree.gone_at is None or t_fault is None else round(tree.gone_at - t_fault, 2)
    aborted = len(lines) >= 2 and lines[-1] == "data: [DONE]" and '"finish_reason":"abort"' in lines[-2].replace(" ", "")
    if startup:
        result.user_sees = f"the server stops before serving (exit {result.exit_code}); its engine core goes with it"
    elif row["signal"] == "SIGKILL":
        result.num_requests, result.failed = 1, 1
        result.user_sees = f"the stream breaks off after {len(lines)} chunks (the server is gone)"
    else:
        result.num_requests, result.failed = 1, 1 if aborted else 0
        result.user_sees = ("the stream ends with finish_reason=abort and [DONE]; exit 0" if aborted
                            else f"stream ended with {lines[-2:]}")
    with socket.socket() as s:  # as a restarted server binds it (uvicorn: SO_REUSEADDR, so the killed server's
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections in TIME_WAIT do not count)
        try:
            s.bind(("127.0.0.1", port))
            result.port_free = True
        except OSError:
            result.port_free = False
    return judge(row, result)


def _stream_when_healthy(proc: subprocess.Popen, base: str, lines: list[str]) -> threading.Thread:
    """Wait until the server answers ``/health`` 200, start a 400-token streaming completion on a thread (its
    lines go to ``lines``) and return once the first chunk arrived."""
    import httpx

    end = time.monotonic() + 180
    while time.monotonic() < end and proc.poll() is None:
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
    return reader


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
    elif kind == "server_signal" and row["signal"] in ("SIGTERM", "SIGINT") and row["phase"] == "stream" and (
            r.exit_code != 0 or not r.failed):
        problems.append("the server did not end the stream with an abort and exit 0")
    if kind in KILLS or (kind == "server_signal" and (row["signal"] == "SIGKILL" or row["phase"] == "startup")):
        if r.detect_s is None or r.detect_s > GONE_WITHIN_S:
            problems.append(f"processes of the run outlived the fault by {r.detect_s} s (bound {GONE_WITHIN_S:g} s)")
    if r.why:
        problems.append(r.why)
    r.passed, r.why = not problems, "; ".join(problems)
    return r


def render(results: list[RowResult]) -> str:
    """The Markdown table of ``docs/results.md``."""
    header = ["row", "what the user sees", "exit", "detect (s)", "requests in flight / failed / served",
              "left (procs, segments, port)", "pass"]
    body = []
    for r in results:
        left = "none" if not (r.leftover_pids or r.leftover_shm or r.port_free is False) else \
            f"{len(r.leftover_pids)} procs, {len(r.leftover_shm)} segs, port {'free' if r.port_free else 'held'}"
        body.append([r.label, r.user_sees[:150], r.exit_code, "-" if r.detect_s is None else f"{r.detect_s:.1f}",
                     f"{r.num_requests} / {r.failed} / {r.served}", left, "yes" if r.passed else "NO: " + r.why])
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executors", default="uniproc,mp1,mp2,ray2,dp2",
                   help="comma-separated: uniproc, mp1, mp2, ray2, dp2 (two mp replicas)")
    p.add_argument("--only", default="", help="run only rows whose label contains this text")
    p.add_argument("--quick", action="store_true", help="leave out the compile-warm-up rows")
    p.add_argument("--json-out", default=None, help="write the rows as JSON here")
    p.add_argument("--cpus", default=None, help="run every row under taskset -c CPUS (e.g. 0: a slower machine)")
    args = p.parse_args(argv)
    executors = [e for e in args.executors.split(",") if e != "ray2" or importlib.util.find_spec("ray")]
    selected = [r for r in rows(executors, args.quick) if args.only in r["label"]]
    log_dir, results = Path(tempfile.mkdtemp(prefix="fault_matrix_logs_")), []
    for row in selected:
        t0 = time.monotonic()
        results.append(run_row(row, log_dir, args.cpus))
        print(f"{row['label']}: {'pass' if results[-1].passed else 'FAIL ' + results[-1].why} "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(render(results))
    print(f"\nlogs: {log_dir}", file=sys.stderr)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
