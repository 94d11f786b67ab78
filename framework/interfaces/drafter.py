"""Drafter: proposes speculative tokens for each running request (speculative decoding)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    from framework.request import Request


class Drafter(Plugin, ABC):
    """Proposes up to ``num_speculative_tokens`` draft tokens per request.

    The target model verifies the drafts in one forward (Leviathan et al. 2023, "Fast Inference
    from Transformers via Speculative Decoding", Sec. 2.3: rejection sampling keeps the target
    distribution). Config ``spec_decode=none`` selects no drafter.

    Args:
        num_speculative_tokens: k, the draft length per step.
    """

    def __init__(self, num_speculative_tokens: int = 4, **params: Any) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """Draft tokens for each request that is in its decode phase.

        Called by the engine after a step's outputs are appended. Must not mutate requests.

        Returns:
            request_id -> up to ``num_speculative_tokens`` token ids (empty list: no proposal).
        """
