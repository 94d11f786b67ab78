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


def module_cycles(root: Path) -> list[list[str]]:
    """The import circles between the modules of the package at ``root`` (imports anywhere in a file, inside
    functions and ``TYPE_CHECKING`` blocks too): each strongly connected component of more than one module of
    the graph "module -> the modules it imports", as sorted dotted names (Tarjan's algorithm)."""
    package = root.name
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}

    def target(name: str) -> str | None:  # the module a dotted import resolves to (``from pkg import mod``: mod)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                t = target(name) if name.split(".")[0] == package else None
                if t and t not in (module, package) and not module.startswith(t + "."):
                    graph[module].add(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle_between_modules() -> None:
    """0 circles between modules (a circle hidden by imports inside functions still couples both ends)."""
    cycles = module_cycles(FRAMEWORK)
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_circle_check_catches_a_planted_circle(tmp_path: Path) -> None:
    """Negative control: a circle through an in-function import and a ``from pkg import module`` is found."""
    pkg = tmp_path / "framework"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("from framework.engine import b\n")
    (pkg / "engine" / "b.py").write_text("def f():\n    from framework.engine.a import x\n")
    (pkg / "engine" / "c.py").write_text("from framework.engine.a import x\n")
    assert module_cycles(pkg) == [["framework.engine.a", "framework.engine.b"]]
