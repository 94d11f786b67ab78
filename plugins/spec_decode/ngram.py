"""N-gram (prompt-lookup) drafter: copy what followed the last n tokens earlier in the context.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; transformers'
``generate(prompt_lookup_num_tokens=k)``; vLLM's ``ngram`` speculative method): find an earlier
occurrence of the context's last ``n`` tokens, for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, and propose the ``k`` tokens that followed the earliest occurrence.
No weights and no per-request state; shines on input-grounded tasks (summarise, edit, quote).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from framework import hookimpl
from framework.config import EngineConfig
from framework.core.request import Request
from framework.hookspecs import Register
from framework.interfaces import Drafter


def ngram_propose(context: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt-lookup proposal for one token sequence, vectorised over positions.

    For ``n`` from ``n_max`` down to ``n_min``: compare every length-``n`` window of
    ``context[:-1]`` with the last ``n`` tokens (one numpy comparison per ``n``); the earliest
    match ``i`` proposes ``context[i + n : i + n + k]`` (as transformers' prompt lookup).

    Args:
        context: (num_tokens,) int64 prompt + output ids.
        k: max tokens to propose.
        n_min, n_max: n-gram sizes to try, ``1 <= n_min <= n_max``.

    Returns:
        0..k token ids (empty when no n-gram recurs).
    """
    length = context.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # (length - n, n)
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return context[start:start + k].tolist()
    return []


class NgramDrafter(Drafter):
    """Prompt-lookup drafter (``spec_decode=ngram``).

    Args:
        num_speculative_tokens: k, tokens proposed per step.
        prompt_lookup_min: smallest n-gram to match (tokens, >= 1).
        prompt_lookup_max: largest n-gram to match (tokens, >= prompt_lookup_min).

    Raises:
        ValueError: bad sizes.
    """

    name = "ngram"

    def __init__(self, num_speculative_tokens: int = 4, prompt_lookup_min: int = 1, prompt_lookup_max: int = 3,
                 **params: Any) -> None:
        super().__init__(num_speculative_tokens, **params)
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, "
                             f"{prompt_lookup_max}")
        self.n_min, self.n_max = int(prompt_lookup_min), int(prompt_lookup_max)

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Base checks plus the n-gram sizes."""
        problems = super().validate(config)
        p = config.drafter_params
        n_min, n_max = p.get("prompt_lookup_min", 1), p.get("prompt_lookup_max", 3)
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            problems.append(f"spec_decode 'ngram': need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                            f"{n_min!r}, {n_max!r}")
        return problems

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Per request, up to k tokens that followed the earliest earlier match of its last n-gram."""
        return {r.request_id: ngram_propose(np.asarray(r.all_token_ids, dtype=np.int64), self.num_speculative_tokens,
                                            self.n_min, self.n_max) for r in requests}


@hookimpl
def register_drafters(register: Register) -> None:
    """Register ``ngram``."""
    register("ngram", NgramDrafter)
