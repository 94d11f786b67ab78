"""``grammar=xgrammar``: structured output with XGrammar (Dong et al. 2024, arXiv:2411.15100),
vLLM's default backend. Pushdown automaton with a precomputed context-independent token cache."""

from __future__ import annotations

import json
from typing import Any

import torch

from framework import hookimpl
from framework.hookspecs import Register
from framework.interfaces import Grammar, GrammarMatcher


class XGrammarMatcher(GrammarMatcher):
    """One request's ``xgrammar.GrammarMatcher`` (unbounded rollback)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """See :meth:`GrammarMatcher.fill_bitmask`."""
        self._m.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        """See :meth:`GrammarMatcher.accept_token`."""
        return bool(self._m.accept_token(int(token_id)))

    def validate_tokens(self, token_ids: list[int]) -> int:
        """See :meth:`GrammarMatcher.validate_tokens` (accepts then rolls back)."""
        n = 0
        for t in token_ids:
            if not self._m.accept_token(int(t)):
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, num_tokens: int) -> None:
        """See :meth:`GrammarMatcher.rollback`."""
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """See :meth:`GrammarMatcher.is_terminated`."""
        return bool(self._m.is_terminated())


class XGrammar(Grammar):
    """XGrammar compiler for the model's tokenizer.

    Params (``grammar.params``): ``any_whitespace`` (bool, default False: compact JSON, as vLLM's
    ``disable-any-whitespace``) and ``max_threads`` (compiler threads, default 1).

    Raises:
        ValueError: from :meth:`compile` for a malformed schema, regex or EBNF.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, eos_token_ids: frozenset[int] = frozenset(),
                 any_whitespace: bool = False, max_threads: int = 1) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        import xgrammar as xgr

        self._xgr = xgr
        self.any_whitespace = any_whitespace
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)

    def compile(self, kind: str, spec: str) -> Any:
        """See :meth:`Grammar.compile`; ``grammar`` specs are XGrammar EBNF (GBNF-style, ``root ::= ...``)."""
        try:
            if kind == "json":
                return self._compiler.compile_json_schema(spec, any_whitespace=self.any_whitespace)
            if kind == "json_object":  # an object, as vLLM's xgrammar backend (the builtin grammar takes any value)
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                alts = " | ".join(json.dumps(c) for c in json.loads(spec))
                return self._compiler.compile_grammar(f"root ::= {alts}")
            if kind == "grammar":
                return self._compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"xgrammar cannot compile the {kind} constraint: {e}") from e
        raise ValueError(f"unknown structured-output kind {kind!r}")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """See :meth:`Grammar.matcher`."""
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled))


@hookimpl
def register_grammars(register: Register) -> None:
    """Register ``xgrammar``."""
    register("xgrammar", XGrammar)
