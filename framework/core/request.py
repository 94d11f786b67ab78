"""The engine's unit of work: one prompt and its growing output (vLLM V1 ``Request``)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.core.lora_request import LoRARequest
from framework.core.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    """Where a request is in its life; the scheduler owns the transitions."""

    WAITING = "waiting"  # queued; holds no KV blocks
    RUNNING = "running"  # admitted; holds KV blocks
    PREEMPTED = "preempted"  # evicted by recompute; back in the waiting queue, blocks freed
    # admitted with an asynchronous KV connector load in flight (vLLM's name): holds its blocks, in no queue and in
    # no step until the connector reports the load done (framework/core/kv_transfer.py)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # aborted by the caller or rejected

    @property
    def finished(self) -> bool:
        """True for the three terminal states."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class RequestTimes:
    """Wall-clock timestamps of one request, ``time.perf_counter()`` seconds; set by the engine."""

    arrival_s: float  # add_request time (or the workload's arrival time)
    first_scheduled_s: float | None = None  # first step that computed any of its tokens
    first_token_s: float | None = None  # first output token sampled
    token_s: list[float] = field(default_factory=list)  # time each output token was produced
    finished_s: float | None = None  # when it reached a terminal state


@dataclass(eq=False)
class Request:
    """One generation request.

    The scheduling rule is vLLM V1's: ``num_computed_tokens`` (tokens whose K/V are in the cache)
    catches up with ``num_tokens`` (prompt + output). A prompt chunk, a decode token and a
    recompute after preemption are all just "uncomputed tokens".

    Set by: the engine (construction), the scheduler (status, num_computed_tokens, output
    tokens, stop state), the model runner (nothing: it only reads).
    """

    request_id: str
    prompt_token_ids: list[int]  # (num_prompt_tokens,) token ids
    sampling_params: SamplingParams
    prompt: str | None = None  # original text, if any
    priority: int = 0  # lower is served first (vLLM convention)
    client_id: str | None = None  # who sent it (fair-share scheduling); None = the anonymous client
    arrival_time: float = field(default_factory=time.perf_counter)  # seconds, perf_counter clock
    eos_token_ids: frozenset[int] = frozenset()  # model EOS ids (generation_config), may be several
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)  # sampled tokens, in order
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output; filled in __post_init__
    num_computed_tokens: int = 0  # tokens whose K/V are written to the paged cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0  # times this request was preempted (recompute)
    # KV blocks held per KV cache group after its latest allocation, and when their total was largest
    # (a prefill chunk's, with sliding windows); set by the scheduler after each allocation
    kv_blocks: tuple[int, ...] = ()
    peak_kv_blocks: tuple[int, ...] = ()
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_text: str = ""  # detokenized output, filled at finish (and for stop-string checks)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, top-N + sampled
    # per prompt token whose logprob is known so far (sampling_params.prompt_logprobs): None for token 0, then
    # top-N + the prompt token; complete (num_prompt_tokens entries) once the prefill is done; filled by the scheduler
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    error: str | None = None  # why it was rejected or failed (FINISHED_ABORTED only)
    internal_error: bool = False  # error is a fault of the server (plugin, detokenizer), not a rejected request
    generator: torch.Generator | None = None  # per-request RNG when sampling_params.seed is set
    seq_no: int = field(default_factory=lambda: next(_arrival_counter))  # FIFO tie-breaker
    # draft tokens proposed for the next step (speculative decoding); never output, never hashed
    # into the prefix cache; set by the engine from the drafter, cleared by the scheduler
    spec_token_ids: list[int] = field(default_factory=list)
    # with a draft tree (framework/core/spec_tree.py): each draft's parent index, -1 = the last real token; empty:
    # the drafts are a chain. Set and cleared with spec_token_ids
    spec_parents: list[int] = field(default_factory=list)
    # the LoRA adapter it runs under (None: the base model); set at construction by the engine's processor.
    # The scheduler counts distinct adapters per step (max_loras), the KV allocator salts its prefix hashes with it
    lora_request: LoRARequest | None = None
    # what the KV connector returned when the request finished (vLLM's kv_transfer_params); set by the scheduler
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.times = RequestTimes(arrival_s=self.arrival_time)
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob (vLLM)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output length in tokens."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Prompt + output + draft tokens (vLLM V1): what the scheduler catches up with."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output length in tokens."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal status."""
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish reason: ``stop``, ``length``, ``abort`` or None while running."""
        return self.status.value if self.status.finished else None

    def append_output_token(self, token_id: int) -> None:
        """Append one sampled token to the output and to ``all_token_ids``."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
