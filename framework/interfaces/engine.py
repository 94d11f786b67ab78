"""The engine interface every front drives (vLLM V1's ``EngineCoreClient`` role, typed).

:class:`EngineClient` is what ``LLM``, the offline runner, :class:`~framework.engine.core.EngineCore` and the
server's in-process front call: one :class:`~framework.engine.llm_engine.LLMEngine`, or a
:class:`~framework.engine.data_parallel.DataParallelEngine` of several behind a router. Code holding an engine
types it as ``EngineClient`` and calls these methods, never probing for attributes: a front says what it is
through :meth:`EngineClient.replica_views` (one view for one engine, one per replica for a data-parallel front).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from framework.config import EngineConfig
    from framework.core.clock import Clock
    from framework.core.lora_request import LoRARequest
    from framework.core.outputs import RequestOutput
    from framework.core.sampling_params import SamplingParams
    from framework.core.structured_output import StructuredOutputManager
    from framework.interfaces.kv_allocator import KVAllocator
    from framework.interfaces.router import ReplicaState


class ReplicaView(NamedTuple):
    """One replica of a front as its core publishes it: the replica's own engine, whether it still serves and
    how many requests the front routed to it (0 for a single engine, which routes nothing)."""

    engine: ReplicaEngine
    alive: bool
    num_routed: int


@runtime_checkable
class ReplicaEngine(Protocol):
    """What a single replica exposes about its load (``LLMEngine`` does): its state for routers, its KV
    allocator's counters and its metrics collector."""

    metrics: Any  # MetricsCollector: num_generated_tokens, num_preemptions, summary(...)

    @property
    def kv_allocator(self) -> KVAllocator:
        """The replica's KV allocator (``stats()``: prefix-cache queries and hits, tokens)."""

    def replica_state(self, replica_id: int) -> ReplicaState:
        """The replica's load now (waiting / running requests, KV usage), named ``replica_id``."""

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """Names of the LoRA adapters of the replica's running and of its waiting requests now, each sorted
        and without repeats (both empty without LoRA): the server's ``servelab:lora_requests_info`` gauge."""


@runtime_checkable
class EngineClient(Protocol):
    """An engine behind one front: requests in, outputs out, one :meth:`step` at a time (one thread).

    Attributes:
        config: the resolved config (``dtype`` resolved; ``data_parallel_size`` of the whole front).
        tokenizer: the model's tokenizer (transformers).
        vocab_size: logits columns; eos_token_ids: token ids that end a request; max_model_len: prompt + output
            cap, tokens.
        structured_output: the grammar manager, or ``None`` without ``grammar``.
        clock: wall time, or a simulator's virtual time.
        metrics: the front's collector (``summary()`` is ``metrics.json``).
        compile_decision: the last ``engine.compile`` decision (``framework.compilation.policy.CompileDecision``).
    """

    config: EngineConfig
    tokenizer: Any
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    structured_output: StructuredOutputManager | None
    clock: Clock
    metrics: Any
    compile_decision: Any

    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, client_id: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (``lora_request``: its LoRA adapter, ``None`` for the base model).

        Raises:
            ValueError: a bad prompt or params, or a ``request_id`` in use (nothing changes).
            EngineDeadError: the engine died (every replica, for a front).
        """

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort requests (unknown ids are ignored); returns their final outputs."""

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that produced tokens.

        Raises:
            EngineDeadError: the engine died (its ``outputs`` hold the in-flight requests' final outputs).
        """

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, as the engine would run it.

        Raises:
            ValueError: an empty or over-long prompt, or ids outside the vocabulary.
        """

    def maybe_compile(self, planned_budgets: Sequence[int] | None, repeats: int = 1) -> Any:
        """``engine.compile=auto``'s decision for the work about to start (``None``: open-ended, a server);
        compiles when it says so; returns the ``CompileDecision``."""

    def check_health(self) -> None:
        """Raises ``EngineDeadError`` when the engine lost a worker while idle."""

    def shutdown(self) -> None:
        """Stop the workers; idempotent."""

    def replica_views(self) -> list[ReplicaView]:
        """Every replica behind this front, in replica order: ``[ReplicaView(self, True, 0)]`` for one engine."""
