"""The packages of ``framework/`` import only downward (docs/architecture.md, "one package per layer"),
and ``framework/`` never imports the built-in ``plugins`` package."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

FRAMEWORK = REPO / "framework"
# rank of each top-level module / package of framework/; a module may import ranks <= its own
RANKS = {
    "config": 0, "known_warnings": 0, "platform": 0, "registry": 0, "hookspecs": 0, "interfaces": 0, "core": 0,
    "distributed": 1,
    "model_executor": 2, "sample": 2, "metrics": 2, "workloads": 2,
    "compilation": 3, "sim": 3,
    "worker": 4,
    "executor": 5, "testing": 5,
    "engine": 6,
    "entrypoints": 7,
}


def _unit(module: str) -> str | None:
    """``framework.core.request`` -> ``core``; ``framework`` itself -> None (the public facade)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "framework" and len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, top-level and inside functions alike."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "framework":  # from framework import registry, hookspecs, ...
                found += [(node.lineno, f"framework.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def test_every_framework_unit_has_a_rank() -> None:
    units = {p.stem if p.is_file() else p.name for p in FRAMEWORK.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())}
    assert units <= set(RANKS), f"give these a layer in RANKS and docs/architecture.md: {units - set(RANKS)}"


def test_layers_import_only_downward() -> None:
    violations = []
    for path in sorted(FRAMEWORK.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel == Path("framework/__init__.py"):
            continue  # the public facade re-exports names of every layer (lazily)
        own = RANKS[rel.parts[1].removesuffix(".py")]
        for line, module in _imports(path):
            if module.split(".")[0] == "plugins":
                violations.append(f"{rel}:{line} imports the built-in plugins package ({module})")
            unit = _unit(module)
            if unit in RANKS and RANKS[unit] > own:
                violations.append(f"{rel}:{line} ({rel.parts[1]}, rank {own}) imports {module} (rank {RANKS[unit]})")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_layering_check_catches_an_upward_import(tmp_path: Path) -> None:
    """Negative control: the parser sees an import inside a function body."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from framework.entrypoints.llm import LLM\n    from framework import registry\n")
    assert _imports(bad) == [(2, "framework.entrypoints.llm"), (3, "framework.registry")]
