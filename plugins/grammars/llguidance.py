"""``grammar=llguidance``: structured output with llguidance (Microsoft guidance's Earley/derivative
parser with a token trie; vLLM's ``guidance`` backend)."""

from __future__ import annotations

import json
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import Grammar, GrammarMatcher

_FORMATS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}


class LLGuidanceMatcher(GrammarMatcher):
    """One request's ``llguidance.LLMatcher``."""

    def __init__(self, matcher: Any) -> None:
        import llguidance.torch

        self._m = matcher
        self._fill = llguidance.torch.fill_next_token_bitmask

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """See :meth:`GrammarMatcher.fill_bitmask`."""
        self._fill(self._m, bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        """See :meth:`GrammarMatcher.accept_token`."""
        if self._m.validate_tokens([int(token_id)]) != 1:
            return False
        return bool(self._m.consume_token(int(token_id)))

    def validate_tokens(self, token_ids: list[int]) -> int:
        """See :meth:`GrammarMatcher.validate_tokens`."""
        return int(self._m.validate_tokens([int(t) for t in token_ids]))

    def rollback(self, num_tokens: int) -> None:
        """See :meth:`GrammarMatcher.rollback`."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """See :meth:`GrammarMatcher.is_terminated` (llguidance: ``is_stopped``)."""
        return bool(self._m.is_stopped())


def _byte_preserving_tokenizer_json(tokenizer: Any) -> str:
    """The HF fast tokenizer's ``tokenizer.json`` for llguidance, with a byte-preserving normalizer.

    llguidance re-tokenizes the bytes a grammar forces (its fast-forward path) and assumes that
    tokenizing a string yields tokens whose bytes concatenate to that string. SentencePiece-style
    normalizers (Llama 2's, stories260K's) prepend ``▁`` and strip or collapse spaces, which breaks
    that assumption and makes masks allow the wrong bytes (after "T" of a forced "The", "e" instead
    of "he"). The vocabulary and decoder are kept; the normalizer is reduced to its space -> ``▁``
    replacement, which is what the vocabulary's pieces encode.

    Raises:
        ValueError: for a slow (non-``tokenizers``) tokenizer, which llguidance cannot use.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("grammar=llguidance needs a fast (tokenizers-backed) tokenizer; use grammar=xgrammar")
    spec = json.loads(backend.to_str())
    spec["padding"] = spec["truncation"] = None
    norm = spec.get("normalizer") or {}
    steps = norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
    if any(step.get("type") == "Prepend" for step in steps):
        spec["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    return json.dumps(spec)


class LLGuidance(Grammar):
    """llguidance compiler for the model's tokenizer.

    Params (``grammar.params``): ``any_whitespace`` (bool, default False: compact JSON).

    Raises:
        ValueError: from :meth:`compile` for a malformed schema, regex or grammar (GBNF or Lark).
    """

    name = "llguidance"

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, eos_token_ids: frozenset[int] = frozenset(),
                 any_whitespace: bool = False) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import llguidance

        self._ll = llguidance
        eos = sorted(eos_token_ids) or None  # every EOS id ends the output
        self._tok = llguidance.LLTokenizer(_byte_preserving_tokenizer_json(tokenizer), n_vocab=vocab_size or None,
                                           eos_token=eos)
        self.any_whitespace = any_whitespace

    def compile(self, kind: str, spec: str) -> Any:
        """See :meth:`Grammar.compile`; returns the validated grammar text."""
        if kind == "json_object":
            kind, spec = "json", '{"type": "object"}'
        if kind not in _FORMATS:
            raise ValueError(f"unknown structured-output kind {kind!r}")
        try:
            if kind == "json":
                schema = json.loads(spec)
                if isinstance(schema, dict) and not self.any_whitespace:
                    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                                       "key_separator": ":"}}
                grammar = self._ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            else:
                grammar = self._ll.grammar_from(_FORMATS[kind], spec)
            error = self._ll.LLMatcher.validate_grammar(grammar, self._tok)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"llguidance cannot compile the {kind} constraint: {e}") from e
        if error:
            raise ValueError(f"llguidance cannot compile the {kind} constraint: {error}")
        return grammar

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """See :meth:`Grammar.matcher`."""
        m = self._ll.LLMatcher(self._tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(f"llguidance cannot start the grammar: {m.get_error()}")
        return LLGuidanceMatcher(m)


@hookimpl
def register_grammars(register: Register) -> None:
    """Register ``llguidance``."""
    register("llguidance", LLGuidance)
