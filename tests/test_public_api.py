"""Every public name that the README and the docs show third-party code importing resolves, so
moving modules between layer packages (docs/architecture.md) never breaks a plugin package or a user's script."""

from __future__ import annotations

import importlib
import re

import pytest
from helpers import REPO

DOCS = [REPO / "README.md", REPO / "docs" / "plugins.md", REPO / "docs" / "architecture.md",
        *(REPO / "docs" / f"{topic}.md" for topic in (
            "attention", "compile", "evaluation", "models", "parallelism", "quantization", "reliability",
            "scheduling_kv", "serving", "simulator", "spec_decode", "structured_output"))]
# `servelab.plugins` is the entry-point group's name, not a module
NOT_MODULES = {"servelab.plugins"}


def _documented_imports() -> list[tuple[str, str]]:
    """(module, name) for every ``from M import a, b`` line in the docs' code blocks."""
    pairs = []
    for doc in DOCS:
        for module, names in re.findall(r"^\s*from ((?:framework|servelab)[\w.]*) import ([\w, ]+)$",
                                        doc.read_text(encoding="utf-8"), flags=re.M):
            pairs += [(module, n.strip()) for n in names.split(",") if n.strip()]
    return pairs


def _documented_dotted_names() -> list[str]:
    """Every ``framework.x.y`` / ``servelab.x`` name quoted in backticks in the docs."""
    names = set()
    for doc in DOCS:
        names |= set(re.findall(r"`((?:framework|servelab)\.[\w.]+)", doc.read_text(encoding="utf-8")))
    return sorted(names - NOT_MODULES)


def _resolve(dotted: str) -> object:
    """A module, or an attribute of the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize(("module", "name"), _documented_imports())
def test_documented_import_works(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is not None


@pytest.mark.parametrize("dotted", _documented_dotted_names())
def test_documented_name_resolves(dotted: str) -> None:
    assert _resolve(dotted) is not None


def test_package_root_exports() -> None:
    import framework

    for name in framework.__all__:
        assert getattr(framework, name) is not None, name
    from framework.interfaces import __all__ as kinds

    assert {"AttentionBackend", "KVAllocator", "SchedulerPolicy", "Drafter", "QuantMethod", "Grammar",
            "Tracker"} <= set(kinds)


def test_docs_show_imports_at_all() -> None:
    """The scans above find something (a doc reshuffle must not silently empty them)."""
    assert ("framework", "hookimpl") in _documented_imports()
    assert "framework.interfaces" in _documented_dotted_names()
