"""Registry robustness: a broken entry point only warns, a name clash names both packages, an
interface-version mismatch is a clear error."""

from __future__ import annotations

import types
from importlib import metadata

import pytest

from framework import hookimpl, registry
from framework.interfaces import SchedulerPolicy
from framework.interfaces.base import INTERFACE_VERSION


class FakeDist:
    def __init__(self, name: str) -> None:
        self.metadata = {"Name": name}
        self.version = "9.9"


class FakeEntryPoint:
    def __init__(self, name: str, dist: str, loader) -> None:
        self.name, self.dist, self._loader = name, FakeDist(dist), loader

    def load(self):
        return self._loader()


def scheduler_module(name: str, version: int = INTERFACE_VERSION) -> types.ModuleType:
    cls = type(f"{name.title()}Policy", (SchedulerPolicy,), {"name": name, "interface_version": version,
                                                               "key": lambda self, request: (0,)})
    module = types.ModuleType(f"fake_{name}")

    @hookimpl
    def register_schedulers(register):
        register(name, cls)

    module.register_schedulers = register_schedulers
    return module


@pytest.fixture
def fresh_registry(monkeypatch):
    """A plugin manager built from the real entry points plus the fakes the test appends."""
    extra: list[FakeEntryPoint] = []
    real = metadata.entry_points

    def entry_points(group):
        return [*real(group=group), *extra]

    monkeypatch.setattr(registry.metadata, "entry_points", entry_points)
    monkeypatch.setattr(registry, "_plugin_manager", None)
    yield extra
    registry._plugin_manager = None  # the next test rebuilds from the real entry points


def test_broken_entry_point_warns_with_package_and_error_and_others_load(fresh_registry):
    def boom():
        raise ImportError("No module named 'nonexistent_dep'")

    fresh_registry.append(FakeEntryPoint("broken", "servelab-broken-plugin", boom))
    fresh_registry.append(FakeEntryPoint("good", "servelab-good-plugin", lambda: scheduler_module("good")))
    with pytest.warns(RuntimeWarning, match=r"servelab-broken-plugin.*nonexistent_dep"):
        names = registry.choices("scheduler")
    assert {"fcfs", "priority", "good"} <= set(names)


def test_same_name_from_two_packages_names_both(fresh_registry):
    fresh_registry.append(FakeEntryPoint("a", "pkg-alpha", lambda: scheduler_module("twin")))
    fresh_registry.append(FakeEntryPoint("b", "pkg-beta", lambda: scheduler_module("twin")))
    with pytest.raises(registry.PluginConflictError, match=r"'twin'.*pkg-alpha.*pkg-beta|'twin'.*pkg-beta.*pkg-alpha"):
        registry.available("scheduler")


def test_interface_version_mismatch_is_a_clear_error(fresh_registry):
    fresh_registry.append(FakeEntryPoint("old", "pkg-old", lambda: scheduler_module("old", version=0)))
    with pytest.raises(registry.PluginVersionError, match=rf"pkg-old.*v0.*v{INTERFACE_VERSION}"):
        registry.get_class("scheduler", "old")
