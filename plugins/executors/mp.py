"""``executor=mp``: one spawned worker process per rank on this machine (vLLM's ``MultiprocExecutor``).

Calls go to every rank at once through one shared-memory ring
(:class:`framework.distributed.shm_broadcast.ShmBroadcast`: the step's message is pickled once, never
whole requests: see ``framework.core.step_message``); replies come back over one pipe per rank,
from the driver rank only for ``execute_model`` (from every rank with a KV connector, a stage before the
last possibly a step ahead). The driver waits on those pipes and on the processes' sentinels together,
in ticks of at most a second, checking each rank's heartbeat and the call's deadline between ticks
(``framework.executor.deadlines``): a rank that exits, stops beating or misses the deadline is lost, the executor kills the other ranks and raises
:class:`~framework.interfaces.EngineDeadError`. One call at a time (a lock): a metrics read from
another thread cannot interleave with a step on the ring. Nothing of the ring has a name (a memfd
and pipes), and stale segments of dead servelab processes are swept at start
(``framework.distributed.shm_segment``); worker processes are released by
:meth:`MultiprocExecutor.shutdown`, at interpreter exit (Ctrl-C included), on SIGTERM (a handler is
installed when none is), and die with the driver however it ends (``framework.distributed.child_process``:
the kernel's parent-death signal, their heartbeat thread, their ring pipe's end-of-file).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import weakref
from collections import defaultdict, deque
from multiprocessing.connection import wait
from typing import Any

from framework import hookimpl, registry
from framework.config import EngineConfig
from framework.distributed.process_start import child_launch, child_process, process_context, standard_start_method
from framework.distributed.shm_broadcast import ShmBroadcast
from framework.distributed.shm_segment import sweep_stale_segments
from framework.executor.deadlines import Deadlines, StepDeadline
from framework.executor.kv_output_aggregator import KVOutputAggregator
from framework.hookspecs import Register
from framework.interfaces import EngineDeadError, Executor, WorkerError
from framework.model_executor.pipeline_parallel import pipeline_refusals
from framework.worker.worker_proc import RING, SHUTDOWN, receive, worker_main

_LIVE: weakref.WeakSet = weakref.WeakSet()  # resources of every live executor (for the SIGTERM handler)
_TICK_S = 1.0  # longest wait on the pipes between two checks of heartbeats and deadline


def free_port() -> int:
    """A free TCP port on localhost (torch.distributed's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Resources:
    """The processes, pipes and ring of one executor; :meth:`close` releases them all (idempotent)."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.ring: ShmBroadcast | None = None
        self.lock = threading.Lock()
        self.closed = False

    def close(self, graceful: bool = True) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if graceful and self.ring is not None and all(p.is_alive() for p in self.procs):
            try:
                self.ring.write((SHUTDOWN, (), {}, None), timeout_s=1.0)
            except (TimeoutError, RuntimeError, ValueError):
                pass  # the ring is full or closed: the join below, then the kill, end the workers anyway
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()
        if self.ring is not None:
            self.ring.close()


def _on_sigterm(signum: int, frame: Any) -> None:
    """Release every executor's workers and segment, then die of SIGTERM as if unhandled."""
    for resources in list(_LIVE):
        resources.close(graceful=False)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm_handler() -> None:
    """Clean up on SIGTERM when nobody else handles it (a server installs its own and shuts down)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class MultiprocExecutor(Executor):
    """``parallel.tensor_parallel_size x parallel.pipeline_parallel_size`` ranks, each in a spawned process.

    Under pipeline parallelism rank ``r`` is TP rank ``r % tp`` of stage ``r // tp``; every rank reads
    each step from the ring, the stages hand their hidden states on (``ModelRunner._stage_forward``) and
    the first rank of the last stage (:attr:`driver_rank`) samples and replies. Up to
    :attr:`max_concurrent_batches` (``pipeline_parallel_size``) steps are in flight (vLLM's batch queue): the
    ring carries the steps in order, a stage takes the next one as soon as it handed its hidden states on, so
    stage 0 runs step k+1 while stage 1 still runs step k; the driver rank's replies come back in step order
    and each :class:`~framework.interfaces.executor.StepFuture` collects its own. Any other call first
    collects every step in flight.

    Args:
        chunk_bytes: bytes per chunk of the broadcast ring (messages may span chunks).
        num_chunks: chunks in the ring.
        **params: the bounds of :class:`~framework.executor.deadlines.Deadlines` (``execute_timeout_s``,
            ``min_step_deadline_s``, ``step_deadline_factor``, ``rpc_timeout_s``, ``compile_timeout_s``,
            ``startup_timeout_s``, ``heartbeat_timeout_s``), seconds.

    Raises:
        WorkerError: a rank failed to start; the message holds its traceback (bad weights, out of
            memory...), or names the rank that died, hung or missed ``startup_timeout_s``. Every
            started process is stopped first.
        ValueError: a bound that is not a positive number.
    """

    name = "mp"

    def __init__(self, config: EngineConfig, chunk_bytes: int = 1 << 20, num_chunks: int = 8, **params: Any) -> None:
        self.deadlines, params = Deadlines.from_params(params)
        super().__init__(config, **params)
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.driver_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size  # samples, replies
        self.step_deadline = StepDeadline(self.deadlines)
        # kv_connector: every rank's worker side reports its shard's transfers, merged each step (vLLM's aggregator)
        self.kv_outputs = KVOutputAggregator(self.world_size) if config.kv_connector != "none" else None
        self._last_step_done = 0.0  # time.monotonic() when the driver rank last answered a step
        # rank -> its replies to steps after the one being gathered, oldest first: with a connector every rank replies,
        # and a pipeline stage before the last may answer step k+1 before the last stage answers step k
        self._early: defaultdict[int, deque] = defaultdict(deque)
        ctx = process_context()  # forkserver on Linux: ranks fork from a server that imported torch once
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        _LIVE.add(self._res)
        _install_sigterm_handler()
        sweep_stale_segments()  # what a SIGKILLed servelab left between a segment's creation and its unlink
        self._res.ring = ShmBroadcast(self.world_size, chunk_bytes, num_chunks, ctx)
        self._shm_name = self._res.ring.segment.name
        self._stopped_since: dict[int, float] = {}  # rank -> when it was first seen stopped before beating
        init_method = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else None
        launch = child_launch(ctx)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=False)
            proc = child_process(ctx, worker_main, name=f"servelab-worker-{rank}", daemon=True,
                                 args=(config.to_dict(), rank, self.world_size, init_method,
                                       self._res.ring.reader_handle(rank), child, launch.parent_pid,
                                       launch.started_by_main_thread))
            with standard_start_method():
                proc.start()
            child.close()
            self._res.procs.append(proc)
            self._res.conns.append(parent)
        self._res.ring.forget_readers()  # each rank holds its own pipe end now: a dead rank's makes write() fail
        self._wait_ready()

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Worker processes load plugins from entry points: a plugin registered only at run time
        in this process (a test's throwaway plugin) cannot run there. On CUDA rank ``r`` runs on
        ``cuda:r`` (NCCL needs one GPU per rank): ``device=cuda:N`` with more than one rank, or more
        ranks than visible GPUs, is refused."""
        problems = super().validate(config) + pipeline_refusals(config)
        tp = config.tensor_parallel_size * config.pipeline_parallel_size
        ranks = (f"tensor_parallel_size={tp}" if config.pipeline_parallel_size == 1 else
                 f"tensor_parallel_size x pipeline_parallel_size={tp}")
        if config.device.startswith("cuda") and tp > 1:
            import torch

            if config.device != "cuda":
                problems.append(f"device={config.device!r} pins every rank to one GPU; with {ranks} "
                                "use device=cuda (rank r runs on cuda:r; choose GPUs with CUDA_VISIBLE_DEVICES)")
            elif torch.cuda.is_available() and torch.cuda.device_count() < tp:
                problems.append(f"{ranks} needs {tp} GPUs (one per rank), "
                                f"{torch.cuda.device_count()} visible; lower it or use executor=ray across nodes")
        for kind in ("attention", "quant"):
            name = getattr(config, kind)
            cls_ = registry.get_class(kind, name)
            if cls_ is not None and not _from_entry_point(kind, cls_):
                problems.append(f"executor={cls.name}: {kind} {name!r} is registered only in this process; worker "
                                "processes load plugins from installed entry points (pip install its package)")
        return problems

    # ---- start-up --------------------------------------------------------------------
    def _wait_ready(self) -> None:
        """Until every rank loaded its weights; the ring's name goes once every rank attached."""
        attached: set[int] = set()
        pending = set(range(self.world_size))
        end = time.monotonic() + self.deadlines.startup_timeout_s
        while pending:
            try:
                replies = self._wait(pending, end, "start-up")
            except EngineDeadError as exc:  # killed without a word (e.g. by the kernel's OOM killer), hung, too slow
                raise WorkerError(str(exc)) from None
            for rank, kind, payload in replies:
                if kind == "error":
                    self._res.close(graceful=False)
                    raise WorkerError(f"worker rank {rank} failed to start:\n{payload[1]}")
                if kind == "attached":
                    attached.add(rank)
                    if len(attached) == self.world_size:
                        self._res.ring.unlink()  # the fallback segment's name (no memfd) goes once every rank mapped it
                else:
                    pending.discard(rank)

    # ---- calls -----------------------------------------------------------------------
    def collective_rpc(self, method: str | Any, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, unique_reply_rank: int | None = None) -> list[Any]:
        """Broadcast the call through the ring and gather the replies (see :class:`Executor`); one call at
        a time. ``timeout_s=None``: the call's deadline (``Deadlines.for_call``)."""
        if timeout_s is None:
            timeout_s = self.deadlines.for_call(method, self.config.compile == "true")
        with self._rpc_lock:
            self._resolve_steps()  # the steps in flight answer first: their replies precede this call's
            return self._call(method, args, kwargs or {}, time.monotonic() + timeout_s, unique_reply_rank)

    def _call(self, method: str | Any, args: tuple, kwargs: dict[str, Any], end: float,
              unique_reply_rank: int | None) -> list[Any]:
        self._send(method, args, kwargs, end, unique_reply_rank)
        return self._gather(_name(method), end, unique_reply_rank)

    def _send(self, method: str | Any, args: tuple, kwargs: dict[str, Any], end: float,
              unique_reply_rank: int | None) -> None:
        """Write one call into the ring (every rank reads it)."""
        self.check_health()
        name = _name(method)
        try:
            self._res.ring.write((method, args, kwargs, unique_reply_rank), timeout_s=max(end - time.monotonic(), 0.0),
                                 alive=self._all_alive)
        except RuntimeError:
            raise self._lost(f"{self._dead_rank()} before {name!r}") from None
        except TimeoutError as exc:
            raise self._lost(f"cannot send {name!r} to the workers: {exc}") from exc

    def _gather(self, name: str, end: float, unique_reply_rank: int | None) -> list[Any]:
        """The replies to the oldest call not yet answered, in rank order (see :meth:`collective_rpc`); a reply
        of a rank that already answered this call belongs to a later step in flight and is kept for it."""
        ranks = [unique_reply_rank] if unique_reply_rank is not None else list(range(self.world_size))
        results: dict[int, Any] = {r: self._early[r].popleft() for r in ranks if self._early[r]}
        errors: dict[int, str] = {}  # an awaited rank's error is its answer to this call
        while len(results) + len(errors) < len(ranks):
            for rank, kind, payload in self._wait(set(ranks) - set(results) - set(errors), end, name):
                if kind == "error":
                    failed_method, trace = payload
                    message = f"worker rank {rank} failed in {failed_method} ({_last_line(trace)}):\n{trace}"
                    if failed_method in ("execute_model", RING):  # ranks may be out of step now
                        raise self._lost(self._root_cause(message))
                    if rank not in ranks or rank in results or rank in errors:
                        raise WorkerError(message)  # a non-replying rank's failure in an earlier call
                    errors[rank] = message
                elif rank in results or rank not in ranks:
                    self._early[rank].append(payload)
                else:
                    results[rank] = payload
        if errors:  # raised once every awaited rank answered, so no reply is left to confuse the next call
            raise WorkerError(errors[min(errors)])
        return [results[r] for r in ranks]

    @property
    def max_concurrent_batches(self) -> int:
        """``pipeline_parallel_size``: one step per stage in flight (1 without pipeline parallelism)."""
        return self.config.pipeline_parallel_size

    def _send_step(self, message: Any, scheduler_output: Any) -> Any:
        """Write the step into the ring now; the returned function waits for the driver rank's reply under
        the step deadline (``StepDeadline``: from the step times measured so far, scaled by this step's
        tokens), counted from when the step before it answered (it queues behind the steps in flight)."""
        num_tokens = scheduler_output.total_num_scheduled_tokens
        t_sent = time.monotonic()
        reply_rank = self.driver_rank if self.kv_outputs is None else None  # a connector: every rank's transfers
        self._send("execute_model", (message,), {}, t_sent + self.step_deadline.deadline_s(num_tokens), reply_rank)

        def collect() -> Any:
            t0 = max(t_sent, self._last_step_done)
            replies = self._gather("execute_model", t0 + self.step_deadline.deadline_s(num_tokens), reply_rank)
            out = replies[0] if self.kv_outputs is None else self.kv_outputs.merge_into(replies, self.driver_rank)
            self._last_step_done = time.monotonic()
            self.step_deadline.observe(num_tokens, self._last_step_done - t0)
            return out

        return collect

    def _wait(self, ranks: set[int], end: float, method: str) -> list[tuple[int, str, Any]]:
        """Block until a pipe has a message or a process exits; ``(rank, kind, payload)`` of each
        message read. Any rank's error counts, not only the awaited ranks'. Between ticks of at most
        :data:`_TICK_S`: the deadline ``end`` (``time.monotonic()`` seconds) and every rank's heartbeat.

        Raises:
            EngineDeadError: a process exited, stopped beating, or ``end`` passed.
        """
        conns, procs = self._res.conns, self._res.procs
        while True:
            ready = wait(conns + [p.sentinel for p in procs], min(_TICK_S, max(end - time.monotonic(), 0.0)))
            if ready:
                break
            if time.monotonic() >= end:
                raise self._lost(f"no reply to {method!r} from ranks {sorted(ranks)} within its deadline "
                                 f"({self._deadline_hint(method)}); the ranks were killed")
            silent = self._silent_rank()
            if silent:
                raise self._lost(f"{silent} during {method!r}")
        out, closed = [], False
        for rank, conn in enumerate(conns):
            if conn in ready:
                try:
                    out.append((rank, *receive(conn)))
                except (EOFError, OSError):
                    closed = True  # its process died: reported below
        if closed or any(p.sentinel in ready for p in procs):  # name the dead rank and its exit code
            hint = (" (a script that starts an engine with executor=mp needs an `if __name__ == '__main__':` guard: "
                    "spawned workers re-import it)" if method == "start-up" else "")
            raise self._lost(f"{self._dead_rank()} during {method!r}; see its output above{hint}")
        return out

    def _deadline_hint(self, method: str) -> str:
        """Which bound applied, and the knob that sets it."""
        d = self.deadlines
        if method == "start-up":
            return f"executor.params.startup_timeout_s={d.startup_timeout_s:g}"
        if method == "execute_model":
            return (f"a step deadline from the measured step times: {d.step_deadline_factor:g} x the expected time, "
                    f"within executor.params.min_step_deadline_s={d.min_step_deadline_s:g} and "
                    f"execute_timeout_s={d.execute_timeout_s:g}")
        if d.for_call(method, self.config.compile == "true") == d.compile_timeout_s:
            return f"executor.params.compile_timeout_s={d.compile_timeout_s:g}"
        return f"executor.params.rpc_timeout_s={d.rpc_timeout_s:g}"

    def _silent_rank(self) -> str | None:
        """``worker rank R (pid P) sent no heartbeat ...`` for a rank whose heartbeat is older than
        ``heartbeat_timeout_s``, or that the kernel reports stopped that long before its first heartbeat
        (it was stopped while still importing); ``None`` when every rank is fine."""
        limit, now = self.deadlines.heartbeat_timeout_s, time.monotonic()
        for rank, age in enumerate(self._res.ring.heartbeat_ages_s()):
            pid = self._res.procs[rank].pid
            if age is None:  # not beating yet: only a stopped process is known to be silent
                age = now - self._stopped_since.setdefault(rank, now) if _is_stopped(pid) else None
                if age is None:
                    self._stopped_since.pop(rank, None)
            if age is not None and age > limit:
                return (f"worker rank {rank} (pid {pid}) sent no heartbeat for {age:.1f} s "
                        f"(executor.params.heartbeat_timeout_s={limit:g}): stopped (SIGSTOP, a debugger) or stuck "
                        "holding the GIL")
        return None

    def _dead_rank(self) -> str:
        """``worker rank R (pid P) exited with code C`` for the first rank that exited."""
        procs = self._res.procs
        ready = wait([p.sentinel for p in procs], 5.0)  # a closed pipe may precede the exit by a moment
        for rank, proc in enumerate(procs):
            if proc.sentinel in ready:
                proc.join(5.0)  # its fds close before it is reaped: wait for the exit code
                return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return "a worker closed its pipe without exiting"

    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self._res.procs)

    def _root_cause(self, message: str, grace_s: float = 0.5) -> str:
        """A rank's step error, led by the rank whose process died if one did within ``grace_s``: a stage killed
        mid-step resets its peers' connections a moment before its exit is visible, and it is the cause to name."""
        deadline = time.monotonic() + grace_s
        while self._all_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return message if self._all_alive() else f"{self._dead_rank()}; then {message}"

    def _lost(self, reason: str) -> EngineDeadError:
        """Declare the executor dead: stop every rank at once (SIGKILL: a stopped one too), release the segment."""
        error = self._fail(EngineDeadError(f"executor=mp lost a worker: {reason}"))
        self._res.close(graceful=False)
        return error

    # ---- health and shutdown -----------------------------------------------------------
    def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the executor is dead or a worker process exited."""
        if self.dead is not None:
            raise self.dead
        if self._res.closed:
            raise EngineDeadError("executor=mp is shut down")
        if not self._all_alive():
            raise self._lost(self._dead_rank())
        silent = self._silent_rank()
        if silent:
            raise self._lost(silent)

    def shutdown(self) -> None:
        """Ask every rank to exit, kill those that do not within 5 s, unlink the segment."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks (tests, monitoring)."""
        return [p.pid for p in self._res.procs]

    @property
    def shm_name(self) -> str | None:
        """Name the broadcast segment had at start (``/dev/shm/<name>``, unlinked once every rank attached)
        where there is no ``memfd``; None where it never had one (Linux)."""
        return self._shm_name


def _last_line(trace: str) -> str:
    """The exception line of a traceback (``Type: message``)."""
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no traceback"


def _is_stopped(pid: int) -> bool:
    """True when the kernel reports the process stopped (SIGSTOP, SIGTSTP, a tracer)."""
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _name(method: str | Any) -> str:
    """A call's name for messages: the method, or the callable's qualified name."""
    return method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))


def _from_entry_point(kind: str, cls: type) -> bool:
    """True when ``cls`` reaches the registry through an installed entry point (so a fresh process sees it)."""
    pm = registry.plugin_manager()
    hook = getattr(pm.hook, registry.KINDS[kind][0])
    for impl in hook.get_hookimpls():
        found: list[type] = []
        impl.function(register=lambda name, c, found=found: found.append(c))
        if cls in found:
            return registry.plugin_source(impl.plugin)[0] != "(runtime)"
    return False


@hookimpl
def register_executors(register: Register) -> None:
    """Register ``mp``."""
    register("mp", MultiprocExecutor)
