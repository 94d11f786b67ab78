"""What crosses the boundary between the API front and an engine core (vLLM V1's ``EngineCoreRequest`` /
``EngineCoreOutputs``), and its wire format.

The same message objects travel in both layouts: in-process (``server.engine_process=false``) they are handed
over through a queue as they are; with the engine core in its own process they are msgpack-encoded with
``msgspec`` (a ``RequestOutput`` of one decode token is ~100 bytes) and sent over ZMQ. The front sends token ids
in (prompts are tokenized on the API side) and gets token deltas out (``RequestOutputKind.DELTA`` outputs, with
their detokenized text: detokenization and stop strings stay in the core, next to the stop checker that ends a
request, so a stop string never costs the core an extra step).

Commands, front -> core: :class:`AddRequest`, :class:`AbortRequests`, :class:`Shutdown`.
Events, core -> front: one :class:`EngineCoreOutputs` per engine step (outputs, rejections, load), and the
life-cycle events ``hello`` (engine built: :class:`EngineFacts`), ``ready`` (start-up work such as the compile
warm-up done), ``failed`` (the build refused the config), ``dead`` (the engine's state is unknown),
``stopped`` (after :class:`Shutdown`, with the metrics summary).
"""

from __future__ import annotations

from typing import Any

import msgspec

from framework.core.lora_request import LoRARequest
from framework.core.outputs import RequestOutput, SchedulerStats
from framework.core.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    """Queue one request on the core (``LLMEngine.add_request``); a refusal comes back in
    :attr:`EngineCoreOutputs.rejected`."""

    request_id: str
    prompt: list[int] | str  # (num_prompt_tokens,) token ids (the server tokenizes), or text the core tokenizes
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None  # seconds on the core's clock; None = when the core takes it
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs under (the server's ``model`` field); None: base


class AbortRequests(msgspec.Struct, tag="abort"):
    """Abort requests (unknown ids are ignored); each running one comes back finished with ``abort``."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Abort everything in flight (each gets its final output), send ``stopped`` and exit the loop."""


CoreCommand = AddRequest | AbortRequests | Shutdown


RECENT_KV_TRANSFERS = 64  # (bytes, seconds) records a ReplicaStats carries at most


class ReplicaStats(msgspec.Struct):
    """One replica's load and cumulative counters, published with every step's outputs (the routers' and
    ``/metrics``' view of it); counters are totals since the replica started."""

    replica_id: int
    alive: bool = True
    num_running_reqs: int = 0  # requests holding KV blocks
    num_waiting_reqs: int = 0  # requests queued (incl. preempted and those whose grammar compiles)
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, [0, 1]
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache, total
    prefix_hits_tokens: int = 0  # of which were found, total
    num_generated_tokens: int = 0  # output tokens, total
    num_preemptions: int = 0  # preemptions, total
    external_prefix_queries_tokens: int = 0  # KV connector: prompt tokens of admissions that asked it, total
    external_prefix_hits_tokens: int = 0  # of which it supplied, total
    num_routed: int = 0  # requests routed to the replica, total (in-process data parallel; the front counts its own)
    running_lora_adapters: list[str] = []  # names of the LoRA adapters of running requests, sorted (LoRA on)
    waiting_lora_adapters: list[str] = []  # names of the LoRA adapters of waiting requests, sorted (LoRA on)
    spec_num_drafts: int = 0  # speculative decoding: verify steps of requests with drafts (vLLM's num_drafts), total
    spec_num_draft_tokens: int = 0  # draft tokens (tree nodes) verified, total
    spec_num_accepted_tokens: int = 0  # draft tokens accepted, total
    spec_accepted_per_pos: list[int] = []  # per draft position (tree depth - 1): drafts accepted there, total
    num_kv_transfers: int = 0  # KV connector transfers finished (zmq pulls...), total
    # the last RECENT_KV_TRANSFERS of them, oldest first: (bytes, seconds) each (the /metrics histograms observe
    # the ones a publication adds; more between two publications than this are counted, not observed)
    recent_kv_transfers: list[tuple[float, float]] = []


class EngineFacts(msgspec.Struct):
    """What the front needs to know about a built engine (the ``hello`` event)."""

    max_model_len: int  # prompt + output cap, tokens
    vocab_size: int  # logits columns
    eos_token_ids: list[int]
    supports_structured_outputs: bool  # grammar != none
    realtime_clock: bool  # the engine's clock follows wall time (a server needs it; executor=sim may not)
    config: dict[str, Any]  # the resolved ``EngineConfig.to_dict()``


class RejectedRequest(msgspec.Struct):
    """A request the core refused: ``engine_dead`` tells a dead engine (503) from a bad request (400)."""

    request_id: str
    message: str
    engine_dead: bool = False


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """One batch of events from a core: a step's outputs and the load after it, or a life-cycle event."""

    outputs: list[RequestOutput] = []
    rejected: list[RejectedRequest] = []
    stats: list[ReplicaStats] = []  # one per replica the core owns (several for an in-process data-parallel front)
    # the core process's ``on_step_end`` hook calls since the previous event, replayed by the front so that plugins
    # registered in the API process (a run's tracker) see them
    step_stats: list[SchedulerStats] = []
    event: str | None = None  # None | "hello" | "ready" | "failed" | "dead" | "stopped"
    message: str = ""  # "failed"/"dead": what happened, naming the fix where there is one
    error_type: str = ""  # "failed": the exception's class names, most derived first, comma-separated
    facts: EngineFacts | None = None  # "hello"
    summary: dict[str, Any] | None = None  # "stopped": the core's metrics summary


class MsgpackCodec:
    """msgpack codec of one message type (msgspec's typed encoder and decoder).

    Args:
        message_type: what :meth:`decode` returns (a ``msgspec.Struct`` or a union of them).
    """

    def __init__(self, message_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: Any) -> bytes:
        """The wire bytes of ``message``."""
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        """The message of ``data``.

        Raises:
            msgspec.DecodeError: bytes that are not a message of this codec's type.
        """
        return self._decoder.decode(data)


class CommandEncoder(MsgpackCodec):
    """Codec of :data:`CoreCommand` (front side encodes, core side decodes)."""

    def __init__(self) -> None:
        super().__init__(CoreCommand)


class OutputsEncoder(MsgpackCodec):
    """Codec of :class:`EngineCoreOutputs` (core side encodes, front side decodes)."""

    def __init__(self) -> None:
        super().__init__(EngineCoreOutputs)
