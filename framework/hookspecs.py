"""pluggy hook specifications of servelab.

Two families:

* ``register_<kind>(register)`` — each plugin module registers named implementations of a kind
  by calling ``register(name, cls)``; ``cls`` subclasses the kind's ABC in
  ``framework.interfaces``. Built-ins (``plugins/``) and third-party packages (entry-point group
  ``servelab.plugins``) use exactly these hooks.
* lifecycle hooks — observers (trackers, dashboards) called by the engine and ``run.py``.

Every hook is called for all plugins (no ``firstresult``); return values are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from framework.core.outputs import RequestOutput, SchedulerStats

PROJECT_NAME = "servelab"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, type], None]


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler policies (``framework.interfaces.SchedulerPolicy`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``scheduler=<name>``.
    """


@hookspec
def register_kv_allocators(register: Register) -> None:
    """Register KV allocators (``framework.interfaces.KVAllocator`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``kv_cache=<name>``.
    """


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends (``framework.interfaces.AttentionBackend`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``attention=<name>``.
    """


@hookspec
def register_drafters(register: Register) -> None:
    """Register speculative-decoding drafters (``framework.interfaces.Drafter`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``spec_decode=<name>``.
    """


@hookspec
def register_quant_methods(register: Register) -> None:
    """Register quantization methods (``framework.interfaces.QuantMethod`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``quant=<name>``.
    """


@hookspec
def register_grammars(register: Register) -> None:
    """Register structured-output grammars (``framework.interfaces.Grammar`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``grammar=<name>``.
    """


@hookspec
def register_trackers(register: Register) -> None:
    """Register run trackers (``framework.interfaces.Tracker`` subclasses).

    :param register: ``register(name, cls)``; ``name`` becomes ``tracker=<name>``.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors (``framework.interfaces.Executor`` subclasses): how the engine runs its
    worker ranks (in-process, one process per rank, Ray actors).

    :param register: ``register(name, cls)``; ``name`` becomes ``executor=<name>``.
    """


@hookspec
def register_routers(register: Register) -> None:
    """Register routers (``framework.interfaces.Router`` subclasses): which data-parallel replica serves
    each request (``parallel.data_parallel_size > 1``).

    :param register: ``register(name, cls)``; ``name`` becomes ``router=<name>``.
    """


@hookspec
def register_lora_backends(register: Register) -> None:
    """Register LoRA backends (``framework.interfaces.LoRABackend`` subclasses): how a step's batched LoRA
    term (shrink ``x A^T``, expand ``. B^T``, per token's adapter) is computed with ``lora.enable=true``.

    :param register: ``register(name, cls)``; ``name`` becomes ``lora_backend=<name>``.
    """


@hookspec
def register_kv_connectors(register: Register) -> None:
    """Register KV connectors (``framework.interfaces.KVConnector`` subclasses): what moves KV-cache blocks
    between the engine's paged cache and an external store or another engine (vLLM V1's KV connectors).

    :param register: ``register(name, cls)``; ``name`` becomes ``kv_connector=<name>``.
    """


@hookspec
def on_engine_start(config: dict[str, Any]) -> None:
    """Called once when a run starts, before the first step.

    :param config: the resolved run config as a plain dict (Hydra config or engine config).
    """


@hookspec
def on_step_end(stats: SchedulerStats) -> None:
    """Called after every engine step that scheduled work.

    :param stats: the step's ``SchedulerStats`` (queue sizes, tokens, KV usage, time split, s).
    """


@hookspec
def on_request_finished(output: RequestOutput) -> None:
    """Called once per request when it reaches a terminal state (incl. abort/rejection).

    :param output: the final ``RequestOutput``, with ``metrics`` set.
    """


@hookspec
def on_run_end(summary: dict[str, Any]) -> None:
    """Called once when a run ends, after the last request finished.

    :param summary: run metrics (request/s, output tok/s, TTFT/TPOT percentiles, ...).
    """
