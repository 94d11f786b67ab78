"""Grammar: compiles an output constraint and yields per-step token bitmasks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from framework.interfaces.base import Plugin


class GrammarMatcher(ABC):
    """Matching state of one request against a compiled grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask``.

        ``bitmask`` is ``(batch, ceil(vocab_size / 32))`` int32, bit ``t % 32`` of word ``t // 32``
        set when token ``t`` is allowed (xgrammar's layout).
        """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the token violates the grammar."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar accepted a complete output."""


class Grammar(Plugin, ABC):
    """Compiles constraints (JSON schema, regex, EBNF, choice) for a tokenizer's vocabulary.
    Config ``grammar=none`` selects no grammar.

    Raises:
        ValueError: from :meth:`compile` for an unsatisfiable or malformed constraint.
    """

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, **params: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.params = params

    @abstractmethod
    def compile(self, kind: str, spec: str) -> GrammarMatcher:
        """Compile ``spec`` of ``kind`` (``json``, ``regex``, ``ebnf``, ``choice``) into a fresh matcher."""
