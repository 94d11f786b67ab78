"""Meta tests: plugin module <-> entry point <-> registry key <-> conf file line up; hooks are documented."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from framework import hookspecs, registry

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
HOOK_TO_KIND = {hook: kind for kind, (hook, _, _) in registry.KINDS.items()}
PLUGIN_MODULES = sorted(
    p.relative_to(REPO).with_suffix("").as_posix().replace("/", ".")
    for p in (REPO / "plugins").glob("*/*.py") if not p.name.startswith("_"))


def _entry_points() -> dict[str, str]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return pyproject["project"]["entry-points"]["servelab.plugins"]


def test_there_are_plugin_modules():
    assert "plugins.schedulers.fcfs" in PLUGIN_MODULES and "plugins.trackers.wandb" in PLUGIN_MODULES


@pytest.mark.parametrize("module_name", PLUGIN_MODULES)
def test_module_has_entry_point_key_and_conf_file(module_name):
    assert module_name in _entry_points().values(), (
        f'{module_name} has no entry point; add `<key> = "{module_name}"` under '
        '[project.entry-points."servelab.plugins"] in pyproject.toml')
    module = importlib.import_module(module_name)
    stem = module_name.rsplit(".", 1)[1]
    hooks = [name for name in HOOK_TO_KIND if hasattr(module, name)]
    assert hooks, f"{module_name} implements no register_<kind> hook"
    for hook in hooks:
        kind = HOOK_TO_KIND[hook]
        names: list[str] = []
        getattr(module, hook)(register=lambda name, cls, names=names: names.append(name))
        assert names == [stem], f"{module_name} must register exactly {stem!r} (registry key = module name)"
        group = registry.KINDS[kind][2]
        assert (REPO / "conf" / group / f"{stem}.yaml").is_file(), f"missing conf/{group}/{stem}.yaml"


def test_entry_points_point_at_existing_modules():
    for key, target in _entry_points().items():
        assert (REPO / (target.replace(".", "/") + ".py")).is_file(), f"entry point {key} -> missing {target}"


def test_every_hookspec_is_documented():
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
             if hasattr(f, f"{hookspecs.PROJECT_NAME}_spec")]
    assert len(specs) >= len(registry.KINDS) + 4  # register_<kind> hooks + lifecycle hooks
    for spec in specs:
        doc = inspect.getdoc(spec) or ""
        assert doc.strip(), f"hookspec {spec.__name__} has no docstring"
        for param in inspect.signature(spec).parameters:
            assert f":param {param}:" in doc, f"hookspec {spec.__name__} does not document {param!r}"
