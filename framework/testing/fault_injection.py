"""Fault injection into worker ranks, for the isolation tests and ``experiments/faults/fault_matrix.py`` (issue 44).

The per-request sites of the driver rank's model runner (grammar bitmask application, the sampler and
its stages, the rejection sampler) run in the worker's process (``mp``, ``ray``) or in the engine's
(``uniproc``). :func:`inject_worker_fault` is a ``collective_rpc`` callable (it reaches every rank by
reference, so it works through every executor): from then on the chosen site raises
:class:`~framework.testing.faulty_plugins.InjectedFault` whenever a *poisoned* request is in the batch
it works on (a request whose stop strings contain the marker, :data:`~framework.testing.faulty_plugins.FAULT_STOP`
by default). :func:`clear_worker_faults` undoes it. :func:`hang_worker` makes a rank's next call
sleep (a hung plugin on the worker side); :func:`simulate_worker_oom` makes its next step raise the
``RuntimeError`` an allocator raises when memory runs out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from framework.testing.faulty_plugins import FAULT_STOP, InjectedFault

#: worker-side per-request sites :func:`inject_worker_fault` can break
WORKER_SITES = ("sampler", "min_tokens", "logit_bias", "penalties", "top_k_top_p", "grammar_bitmask",
                "rejection_sampler")

_patches: list[tuple[Any, str, Any]] = []  # (owner, attribute, original) to restore
_batch: list[Any] = []  # the requests of the sampler call in progress (one thread per rank)


def _targets() -> dict[str, tuple[Any, str, Callable[[tuple], list] | None]]:
    """site -> (owner, attribute, requests from the call's arguments; None: the sampler call's batch)."""
    import framework.sample.rejection_sampler as rejection_mod
    import framework.sample.sampler as sampler_mod
    import framework.worker.model_runner as runner_mod

    return {
        "sampler": (sampler_mod.Sampler, "__call__", lambda args: args[2]),  # (self, logits, requests)
        "min_tokens": (sampler_mod, "apply_min_tokens", lambda args: args[1]),
        "logit_bias": (sampler_mod, "apply_logit_bias", lambda args: args[1]),
        "penalties": (sampler_mod, "apply_penalties", None),
        "top_k_top_p": (sampler_mod, "apply_top_k_top_p", None),
        "grammar_bitmask": (runner_mod, "apply_grammar_bitmask", lambda args: args[1]),
        "rejection_sampler": (rejection_mod.RejectionSampler, "__call__", lambda args: args[2]),
    }


def _patch(owner: Any, attr: str, replacement: Any) -> None:
    _patches.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, replacement)


def inject_worker_fault(worker: Any, site: str, marker: str = FAULT_STOP) -> None:
    """``collective_rpc`` callable: make ``site`` (one of :data:`WORKER_SITES`) raise ``InjectedFault`` on
    batches holding a request whose stop strings contain ``marker``. Replaces any earlier injection.

    Raises:
        ValueError: an unknown site.
    """
    targets = _targets()
    if site not in targets:
        raise ValueError(f"site must be one of {WORKER_SITES}, got {site!r}")
    clear_worker_faults(worker)

    def poisoned(requests: list[Any]) -> bool:
        return any(marker in (r.sampling_params.stop or ()) for r in requests)

    for name in ("sampler", "rejection_sampler"):  # record each sampling call's batch (for sites given none)
        owner, attr, _ = targets[name]
        original = getattr(owner, attr)

        def tracked(self: Any, logits: Any, requests: list[Any], *args: Any, __original: Any = original,
                    __name: str = name, **kwargs: Any) -> Any:
            _batch[:] = requests
            if __name == site and poisoned(requests):
                raise InjectedFault(f"injected fault in the worker's {site}")
            return __original(self, logits, requests, *args, **kwargs)

        _patch(owner, attr, tracked)
    if site in ("sampler", "rejection_sampler"):
        return
    owner, attr, requests_of = targets[site]
    original = getattr(owner, attr)

    def faulty(*args: Any, **kwargs: Any) -> Any:
        if poisoned(requests_of(args) if requests_of is not None else _batch):
            raise InjectedFault(f"injected fault in the worker's {site}")
        return original(*args, **kwargs)

    _patch(owner, attr, faulty)


def clear_worker_faults(worker: Any) -> None:
    """``collective_rpc`` callable: undo :func:`inject_worker_fault`."""
    while _patches:
        owner, attr, original = _patches.pop()
        setattr(owner, attr, original)
    _batch.clear()


def hang_worker(worker: Any, seconds: float, rank: int | None = None) -> None:
    """``collective_rpc`` callable: the step after this call sleeps ``seconds`` in the forward on ``rank``
    (every rank when ``None``): a plugin that hangs inside a step, its process still beating."""
    if rank is not None and worker.rank != rank:
        return
    runner = worker.runner
    original = runner._forward

    def slow(*args: Any, **kwargs: Any) -> Any:
        runner._forward = original
        time.sleep(seconds)
        return original(*args, **kwargs)

    runner._forward = slow


def simulate_worker_oom(worker: Any, rank: int = 0) -> None:
    """``collective_rpc`` callable: the next forward on ``rank`` raises what an allocator raises when memory
    runs out (``RuntimeError: [enforce fail at alloc_cpu.cpp] ... DefaultCPUAllocator: can't allocate memory``)."""
    if worker.rank != rank:
        return
    runner = worker.runner
    original = runner._forward

    def oom(*args: Any, **kwargs: Any) -> Any:
        runner._forward = original
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 17179869184 bytes. Error code 12 (Cannot allocate memory)")

    runner._forward = oom


def sleep_and_echo(worker: Any, value: Any, seconds: float) -> tuple[int, Any]:
    """``collective_rpc`` callable: ``(rank, value)`` after ``seconds`` (concurrency and deadline tests)."""
    time.sleep(seconds)
    return worker.rank, value


def worker_pid(worker: Any) -> int:
    """``collective_rpc`` callable: the process id of each rank (to signal one)."""
    import os

    return os.getpid()
