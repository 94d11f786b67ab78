"""Drafter: proposes speculative tokens for each running request (speculative decoding)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from framework.interfaces.base import Plugin

if TYPE_CHECKING:
    import torch

    from framework.config import EngineConfig
    from framework.core.outputs import TargetHiddenStates
    from framework.core.request import Request
    from framework.core.spec_tree import DraftTree


class Drafter(Plugin, ABC):
    """Proposes up to ``num_speculative_tokens`` draft tokens per request.

    Drafters only propose; the framework verifies (``framework.sample.rejection_sampler``: greedy
    matching, or rejection sampling per Leviathan et al. 2023, "Fast Inference from Transformers
    via Speculative Decoding", Sec. 2.3, which keeps the target distribution). Config
    ``spec_decode=none`` selects no drafter.

    Life cycle: constructed with its params, :meth:`load` once the target model is loaded, then
    per engine step :meth:`observe_hidden_states` (only when :attr:`needs_hidden_states`),
    :meth:`on_requests_freed` (requests that finished, were aborted or preempted: drop their
    state) and :meth:`propose` (requests in their decode phase).

    A drafter may propose a token tree (:class:`framework.core.spec_tree.DraftTree`) per request instead of a
    chain (Medusa, Cai et al. 2024; SpecInfer, Miao et al. 2023); a chain is the one-branch tree.

    Attributes:
        drafts_trees: class attribute; True when the drafter takes ``spec_decode.params.tree`` (static
            Medusa-style choice paths, or ``dynamic`` where the drafter grows trees itself) and proposes trees;
            :meth:`validate` refuses ``tree`` for the others.
        needs_hidden_states: class attribute; True makes the model runner keep the target's last
            hidden states of every forward (from the same forward, no second pass) and the engine
            hand them to :meth:`observe_hidden_states` (EAGLE-style drafters).

    Args:
        num_speculative_tokens: k, the draft length per step (tokens).

    Raises:
        ValueError: ``num_speculative_tokens < 1``.
    """

    needs_hidden_states: bool = False
    drafts_trees: bool = False

    def __init__(self, num_speculative_tokens: int = 4, **params: Any) -> None:
        if int(num_speculative_tokens) < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}; "
                             "set spec_decode.params.num_speculative_tokens=1 or more (or spec_decode=none)")
        self.num_speculative_tokens = int(num_speculative_tokens)

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Pre-flight checks before weights load: ``num_speculative_tokens >= 1``."""
        problems = super().validate(config)
        tree = config.drafter_params.get("tree")
        if tree is not None and not cls.drafts_trees:
            problems.append(f"spec_decode {cls.name!r} drafts chains only; drop spec_decode.params.tree, or use "
                            "spec_decode=medusa for token trees")
        k = config.drafter_params.get("num_speculative_tokens", 4)
        if not isinstance(k, int) or k < 1:
            problems.append(f"spec_decode {cls.name!r}: num_speculative_tokens must be an integer >= 1, got {k!r}; "
                            "set spec_decode.params.num_speculative_tokens=4 (or spec_decode=none)")
        return problems

    def load(self, model: torch.nn.Module, model_config: Any, config: EngineConfig) -> None:  # noqa: B027
        """Called once after the target model loads; drafters with their own weights load them here.

        The base drafter needs nothing from the target (stateless drafters keep this default).

        Raises:
            ValueError: the drafter does not fit the target (e.g. another vocabulary).
        """

    def observe_hidden_states(self, hidden_states: TargetHiddenStates) -> None:  # noqa: B027
        """Called by the engine after each target forward, before :meth:`on_requests_freed` and
        :meth:`propose`, when :attr:`needs_hidden_states` is True; keeps what later drafts need.

        Rows of draft tokens the verification rejected are included: positions at or beyond the
        request's ``num_computed_tokens`` (read it in :meth:`propose`) are not the target's.
        Drafters that do not ask keep this default and are never called.
        """

    def on_requests_freed(self, request_ids: Iterable[str]) -> None:  # noqa: B027
        """Drop per-request state (KV, hidden states) of finished, aborted or preempted requests.

        Stateless drafters (n-gram) keep this default, which holds nothing to drop.
        """

    @abstractmethod
    def propose(self, requests: list[Request]) -> dict[str, list[int] | DraftTree]:
        """Draft tokens for each request that is in its decode phase.

        Called by the engine after a step's outputs are appended, for running requests whose
        tokens are all computed but the last. Must not mutate requests.

        Returns:
            request_id -> up to ``num_speculative_tokens`` token ids (a chain; empty list: no proposal), or a
            :class:`~framework.core.spec_tree.DraftTree` (tree drafters, ``drafts_trees``).
        """
