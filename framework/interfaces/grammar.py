"""Grammar: compiles an output constraint and yields per-step token bitmasks.

Contract modelled on vLLM V1's ``StructuredOutputBackend`` / ``StructuredOutputGrammar``
(``vllm/v1/structured_output/backend_types.py``): compile once per ``(kind, spec)`` (the engine
caches the compiled object and compiles off the engine loop), then one cheap matcher per request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from framework.interfaces.base import Plugin

#: constraint kinds, vLLM's ``StructuredOutputsParams`` field names
GRAMMAR_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GrammarMatcher(ABC):
    """Matching state of one request against a compiled grammar.

    Speculative decoding uses :meth:`validate_tokens` on a draft (nothing advances) and, after
    advancing on accepted tokens, :meth:`rollback` to undo tokens the verifier rejected.
    """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of ``bitmask``.

        ``bitmask`` is ``(num_rows, ceil(vocab_size / 32))`` int32 on CPU, bit ``t % 32`` of word
        ``t // 32`` set when token ``t`` is allowed (xgrammar's layout).
        """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the token violates the grammar."""

    @abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest prefix of ``token_ids`` the grammar accepts from the current
        state, without advancing (used to truncate speculative drafts)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar accepted a complete output (stop token included)."""


class Grammar(Plugin, ABC):
    """Compiles constraints (JSON schema, regex, choice, EBNF, any JSON object) for a tokenizer's
    vocabulary. Config ``grammar=none`` selects no grammar (structured requests are refused).

    Args:
        tokenizer: the model's HF tokenizer.
        vocab_size: the model's vocabulary size (logits columns, may exceed the tokenizer's).
        eos_token_ids: the model's EOS ids; the grammar allows them once the output is complete.
    """

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, eos_token_ids: frozenset[int] = frozenset(),
                 **params: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.params = params

    @abstractmethod
    def compile(self, kind: str, spec: str) -> Any:
        """Compile ``spec`` of ``kind`` (one of :data:`GRAMMAR_KINDS`; ``json`` and ``choice``
        specs are JSON text, ``json_object`` has an empty spec) into an immutable, thread-safe
        compiled grammar. Runs on a worker thread.

        Raises:
            ValueError: a malformed or unsupported constraint; the message names the problem.
        """

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher (start state) for a grammar returned by :meth:`compile`."""
