"""Registry: built-ins arrive through entry points, names validate, throwaway plugins register."""

from __future__ import annotations

import pytest

from framework import hookimpl, registry
from framework.interfaces import SchedulerPolicy


def test_builtins_registered_through_entry_points():
    import importlib.metadata as md

    eps = {ep.value for ep in md.entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert "plugins.schedulers.fcfs" in eps
    assert {"fcfs", "priority"} <= set(registry.choices("scheduler"))
    assert {"paged", "contiguous"} <= set(registry.choices("kv_allocator"))
    assert "torch" in registry.choices("attention")
    assert registry.choices("drafter")[0] == "none" and registry.create("drafter", "none") is None


def test_unknown_kind_and_name():
    with pytest.raises(KeyError, match="kinds are"):
        registry.available("nope")
    with pytest.raises(registry.UnknownPluginError, match="valid choices: .*fcfs, .*priority"):
        registry.get_class("scheduler", "lifo")


class _Lifo(SchedulerPolicy):
    name = "lifo"

    def key(self, request):
        return (-request.arrival_time, -request.seq_no)


def test_throwaway_plugin_registers_and_unregisters():
    class Plugin:
        @hookimpl
        def register_schedulers(self, register):
            register("lifo", _Lifo)

    with registry.registered(Plugin()):
        assert isinstance(registry.create("scheduler", "lifo"), _Lifo)
    with pytest.raises(registry.UnknownPluginError):
        registry.get_class("scheduler", "lifo")


def test_bad_registrations_rejected():
    class NotAPolicy:
        pass

    class Bad:
        @hookimpl
        def register_schedulers(self, register):
            register("bad", NotAPolicy)

    with registry.registered(Bad()), pytest.raises(TypeError, match="must subclass SchedulerPolicy"):
        registry.available("scheduler")

    class Dup:
        @hookimpl
        def register_schedulers(self, register):
            register("fcfs", _Lifo)

    with registry.registered(Dup()), pytest.raises(TypeError, match="registered twice"):
        registry.available("scheduler")


def test_policy_rejects_params():
    with pytest.raises(TypeError, match="takes no parameters"):
        registry.create("scheduler", "fcfs", aging=1)
