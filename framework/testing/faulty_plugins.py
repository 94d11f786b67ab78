"""Deliberately faulty plugins: fault injection for isolation tests and ``experiments/serving/soak_serving.py``.

Register the module as a plugin (``registry.registered(faulty_plugins)``) to get ``spec_decode=faulty``
and ``grammar=faulty``; register a :class:`FaultyObserver` instance for lifecycle hooks that raise. A
request is *poisoned* when its stop strings contain :data:`FAULT_STOP` (any API can send it, it does not
change what the model generates on the models we test, and every plugin sees ``sampling_params``); the
faulty grammar poisons requests whose constraint text contains it. The engine must fail exactly the
poisoned requests (``finish_reason="abort"``, ``error`` naming the plugin) and run every other one as if
the plugin were sound (issue 34).
"""

from __future__ import annotations

from typing import Any

import torch

from framework import registry
from framework.core.request import Request
from framework.hookspecs import Register, hookimpl
from framework.interfaces import Drafter, Grammar, GrammarMatcher

#: the stop string (or constraint text) that marks a request for fault injection
FAULT_STOP = "<fault-injection>"

DRAFTER_FAULTS = ("propose", "out_of_vocab")
GRAMMAR_FAULTS = ("compile", "matcher", "fill_bitmask", "accept_token", "validate_tokens", "is_terminated")


class InjectedFault(RuntimeError):
    """The exception every faulty plugin raises."""


def is_poisoned(request: Request) -> bool:
    """True when the request asked for fault injection (:data:`FAULT_STOP` among its stop strings)."""
    return FAULT_STOP in request.sampling_params.stop


class FaultyDrafter(Drafter):
    """``spec_decode=faulty``: proposes ``k`` copies of each request's last token (a valid drafter: the target
    verifies drafts, so outputs are unchanged) and fails on poisoned requests.

    Args:
        num_speculative_tokens: k.
        fail_in: ``propose`` (the batched call raises when any request in it is poisoned, so the engine must
            find the culprit) or ``out_of_vocab`` (a poisoned request gets draft id ``-1``).
    """

    name = "faulty"

    def __init__(self, num_speculative_tokens: int = 2, fail_in: str = "propose", **params: Any) -> None:
        super().__init__(num_speculative_tokens, **params)
        if fail_in not in DRAFTER_FAULTS:
            raise ValueError(f"fail_in must be one of {DRAFTER_FAULTS}, got {fail_in!r}")
        self.fail_in = fail_in

    def propose(self, requests: list[Request]) -> dict[str, list[int]]:
        """k copies of the last token; see the class docstring for the faults."""
        if self.fail_in == "propose" and any(is_poisoned(r) for r in requests):
            raise InjectedFault(f"faulty drafter: poisoned request among {len(requests)}")
        return {r.request_id: [-1] if self.fail_in == "out_of_vocab" and is_poisoned(r)
                else [r.all_token_ids[-1]] * self.num_speculative_tokens for r in requests}


class _FaultyMatcher(GrammarMatcher):
    """A real matcher whose method ``fail_in`` raises (when its grammar is poisoned)."""

    def __init__(self, inner: GrammarMatcher, fail_in: str | None) -> None:
        self._inner, self._fail_in = inner, fail_in

    def _check(self, method: str) -> None:
        if method == self._fail_in:
            raise InjectedFault(f"faulty grammar matcher: {method}")

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """The inner matcher's (or a fault)."""
        self._check("fill_bitmask")
        self._inner.fill_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        """The inner matcher's (or a fault)."""
        self._check("accept_token")
        return self._inner.accept_token(token_id)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """The inner matcher's (or a fault)."""
        self._check("validate_tokens")
        return self._inner.validate_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """The inner matcher's."""
        self._inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """The inner matcher's (or a fault)."""
        self._check("is_terminated")
        return self._inner.is_terminated()


class FaultyGrammar(Grammar):
    """``grammar=faulty``: the grammar ``inner`` (default xgrammar), except that constraints whose text contains
    :data:`FAULT_STOP` (e.g. in a JSON schema's ``description``) fail in ``fail_in``: ``compile`` (a
    non-``ValueError``, i.e. a plugin fault, not a bad constraint), ``matcher`` (creating the request's
    matcher) or a matcher method (``fill_bitmask``, ``accept_token``, ``validate_tokens``,
    ``is_terminated``)."""

    name = "faulty"

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, eos_token_ids: frozenset[int] = frozenset(),
                 inner: str = "xgrammar", fail_in: str = "fill_bitmask", **params: Any) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        if fail_in not in GRAMMAR_FAULTS:
            raise ValueError(f"fail_in must be one of {GRAMMAR_FAULTS}, got {fail_in!r}")
        self.fail_in = fail_in
        self.inner = registry.create("grammar", inner, tokenizer=tokenizer, vocab_size=vocab_size,
                                     eos_token_ids=eos_token_ids, **params)

    def compile(self, kind: str, spec: str) -> Any:
        """``(inner compiled grammar, poisoned)``."""
        poisoned = FAULT_STOP in spec
        if poisoned and self.fail_in == "compile":
            raise InjectedFault("faulty grammar: compile")
        return self.inner.compile(kind, spec), poisoned

    def matcher(self, compiled: Any) -> GrammarMatcher:
        """The inner matcher, wrapped to fail when the grammar is poisoned."""
        inner, poisoned = compiled
        if poisoned and self.fail_in == "matcher":
            raise InjectedFault("faulty grammar: matcher")
        return _FaultyMatcher(self.inner.matcher(inner), self.fail_in if poisoned else None)


class FaultyObserver:
    """Lifecycle-hook plugin whose hooks raise (``on_engine_start``, ``on_step_end``, ``on_request_finished``) on
    every ``every``-th call each, counting its calls in ``calls`` (hook name -> number of calls)."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.calls: dict[str, int] = {}

    def _maybe_raise(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1
        if self.calls[hook] % self.every == 0:
            raise InjectedFault(f"faulty observer: {hook}")

    @hookimpl
    def on_engine_start(self, config: dict[str, Any]) -> None:
        """Raises (see the class docstring)."""
        self._maybe_raise("on_engine_start")

    @hookimpl
    def on_step_end(self, stats: Any) -> None:
        """Raises (see the class docstring)."""
        self._maybe_raise("on_step_end")

    @hookimpl
    def on_request_finished(self, output: Any) -> None:
        """Raises (see the class docstring)."""
        self._maybe_raise("on_request_finished")


@hookimpl
def register_drafters(register: Register) -> None:
    """Register ``faulty`` (:class:`FaultyDrafter`)."""
    register("faulty", FaultyDrafter)


@hookimpl
def register_grammars(register: Register) -> None:
    """Register ``faulty`` (:class:`FaultyGrammar`)."""
    register("faulty", FaultyGrammar)
