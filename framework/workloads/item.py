"""One request of a workload (:class:`WorkloadItem`), shared by the prompt-file loader (``workload``) and the
synthetic generators (``synthetic``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_RANDOM_TOKEN_ID = 3  # ids 0-2 are unk/bos/eos in Llama-style vocabularies


@dataclass
class WorkloadItem:
    """One request of a workload; exactly one of ``prompt`` / ``prompt_token_ids`` drives the engine
    (token ids win when both are set; ``prompt`` is then only reported).

    Raises:
        ValueError: when both ``prompt`` and ``prompt_token_ids`` are ``None``.
    """

    request_id: str
    prompt: str | None = None  # text as sent (chat template already applied), or None for token-id prompts
    raw_prompt: str | None = None  # the prompt as the user wrote it (before the chat template); None = ``prompt``
    prompt_token_ids: list[int] | None = None  # (num_prompt_tokens,) ids; bypasses the engine's tokenizer
    priority: int = 0  # lower is served first (priority scheduler)
    max_tokens: int | None = None  # overrides the run's sampling.max_tokens when set
    arrival_time_s: float | None = None  # offset from the run start, seconds; None = at start
    client_id: str | None = None  # sender, for fair-share scheduling (scheduler=fair)
    # vLLM ``structured_outputs`` fields, e.g. {"json": {...schema...}} or {"regex": "..."}
    structured_outputs: dict[str, Any] | None = None
    lora: str | None = None  # LoRA adapter name from ``lora.modules`` (docs/lora.md); None = the base model

    def __post_init__(self) -> None:
        if self.prompt is None and self.prompt_token_ids is None:
            raise ValueError(f"workload item {self.request_id!r} needs a prompt or prompt_token_ids")
