"""Meta-test: every hookspec and every interface method is documented in docs/plugins.md and exercised by
some test (interfaces without any registered implementation yet are only required to be documented)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from framework import hookspecs, registry
from framework.interfaces.grammar import GrammarMatcher

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "plugins.md").read_text()
TESTS = "\n".join(p.read_text() for p in (REPO / "tests").rglob("*.py") if p.name != "test_plugin_docs.py")
TESTS += "\n".join(p.read_text() for p in (REPO / "framework" / "testing").rglob("*.py"))


def hookspec_names() -> list[str]:
    return [n for n, f in vars(hookspecs).items() if inspect.isfunction(f) and hasattr(f, "servelab_spec")]


def interface_methods() -> dict[str, list[str]]:
    out = {}
    for kind, (_, base, _) in registry.KINDS.items():
        out[kind] = [n for n, v in vars(base).items() if not n.startswith("_")
                     and (inspect.isfunction(v) or isinstance(v, property | classmethod))]
    out["grammar"] += [n for n, v in vars(GrammarMatcher).items() if not n.startswith("_") and inspect.isfunction(v)]
    return out


def test_every_hookspec_is_documented_and_tested():
    names = hookspec_names()
    assert len(names) >= 11
    unimplemented = {hook for kind, (hook, _, _) in registry.KINDS.items() if not registry.available(kind)}
    for name in names:
        assert f"`{name}" in DOC, f"hookspec {name} missing from docs/plugins.md"
        if name not in unimplemented:
            assert re.search(rf"\b{name}\b", TESTS), f"hookspec {name} has no test"


def test_every_interface_method_is_documented_and_tested_when_implemented():
    for kind, methods in interface_methods().items():
        implemented = bool(registry.available(kind))
        for name in methods:
            assert f"`{name}" in DOC, f"{kind} interface method {name} missing from docs/plugins.md"
            if implemented:
                assert re.search(rf"\b{name}\b", TESTS), f"{kind} interface method {name} has no test"
