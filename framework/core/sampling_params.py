"""Per-request sampling and stopping parameters (vLLM's ``SamplingParams`` vocabulary)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from framework.core.structured_output_params import StructuredOutputsParams

#: temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``): dividing by less overflows float32 logits
SAMPLING_EPS = 1e-5
_F32_MAX = 3.4028234663852886e38  # largest finite float32: sampling parameters become float32 tensors
_F32_TINY = 1.1754943508222875e-38  # smallest normal float32


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's ``RequestOutputKind``).

    ``CUMULATIVE``: all text/tokens so far, every step. ``DELTA``: only what is new since the
    previous output of that request. ``FINAL_ONLY``: one output, when the request finishes.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request samples tokens and when it stops.

    Field names and semantics follow vLLM's ``SamplingParams`` so that research code moves
    between the two unchanged.

    Raises:
        ValueError: from :meth:`validate` (called in ``__post_init__``) when a value is out of
            range; the message names the field and the accepted range. Nothing is queued.
    """

    # completions of the prompt (parallel sampling): the engine runs n sequences that share the prompt's KV
    # blocks through the prefix cache; with a seed, sequence i samples with seed + i (vLLM's rule)
    n: int = 1
    temperature: float = 1.0  # 0 (anything below SAMPLING_EPS) means greedy (argmax)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 disables
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; in [0, 1]
    seed: int | None = None  # per-request generator seed; None uses the engine's generator
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in prompt or output (CTRL paper)
    presence_penalty: float = 0.0  # OpenAI-style, subtracted once per token seen in the output
    frequency_penalty: float = 0.0  # OpenAI-style, subtracted per occurrence in the output
    max_tokens: int | None = 16  # output-token cap; None means up to max_model_len
    min_tokens: int = 0  # EOS / stop_token_ids are masked until this many output tokens exist
    stop: list[str] = field(default_factory=list)  # stop strings, trimmed from the returned text
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end the request
    ignore_eos: bool = False  # keep generating past the model's EOS ids
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    # what the KV connector reads for this request (vLLM's kv_transfer_params, e.g. a P/D peer); None: nothing
    kv_transfer_params: dict[str, Any] | None = None
    logprobs: int | None = None  # number of top log-probabilities returned per sampled position
    # top log-probabilities returned per prompt token, besides the prompt token's own (vLLM's prompt_logprobs;
    # RequestOutput.prompt_logprobs, None for the first token); such a request does not read the prefix cache
    prompt_logprobs: int | None = None
    # token id -> bias added to its logit before penalties and sampling, in [-100, 100] (OpenAI's logit_bias)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True  # passed to the tokenizer when detokenizing
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what each step's RequestOutput holds
    structured_outputs: StructuredOutputsParams | None = None  # output constraint (needs grammar != none)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Check every field's range.

        Raises:
            ValueError: naming the offending field, its value and the accepted range.
        """
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in floats:  # NaN fails every range check below, but inf (or a float32 overflow) passes some
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= _F32_MAX):
                raise ValueError(f"Invalid SamplingParams: {name} must be a finite float32 number, got {value!r}")
        checks: list[tuple[bool, str]] = [
            (isinstance(self.n, int) and self.n >= 1, f"n must be an int >= 1, got {self.n!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 0, f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty >= _F32_TINY,  # a float32 zero would turn masked -inf logits into NaN
             f"repetition_penalty must be > 0 (at least 1.2e-38, float32), got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1 or None, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0 or None, got {self.logprobs}"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
             f"prompt_logprobs must be >= 0 or None, got {self.prompt_logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must hold non-empty strings, got {self.stop!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"),
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**64),
             f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}"),
            (self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and isinstance(b, (int, float)) and math.isfinite(b) and -100 <= b <= 100
                for t, b in self.logit_bias.items())),
             f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {self.logit_bias!r}"),
            (isinstance(self.output_kind, RequestOutputKind),
             f"output_kind must be a RequestOutputKind, got {self.output_kind!r}"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             f"structured_outputs must be StructuredOutputsParams or None, got {self.structured_outputs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid SamplingParams: {message}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0, or below ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition/presence/frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
