"""Plugin registry: one pluggy ``PluginManager`` that loads the ``servelab.plugins`` entry points
(built-ins included) and maps ``(kind, name)`` to implementation classes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pluggy

from framework import hookspecs
from framework.interfaces import (
    AttentionBackend,
    Drafter,
    Grammar,
    KVAllocator,
    QuantMethod,
    SchedulerPolicy,
    Tracker,
)

ENTRY_POINT_GROUP = "servelab.plugins"

# kind -> (hook name, ABC, Hydra config group)
KINDS: dict[str, tuple[str, type, str]] = {
    "scheduler": ("register_schedulers", SchedulerPolicy, "scheduler"),
    "kv_allocator": ("register_kv_allocators", KVAllocator, "kv_cache"),
    "attention": ("register_attention_backends", AttentionBackend, "attention"),
    "drafter": ("register_drafters", Drafter, "spec_decode"),
    "quant": ("register_quant_methods", QuantMethod, "quant"),
    "grammar": ("register_grammars", Grammar, "grammar"),
    "tracker": ("register_trackers", Tracker, "tracker"),
}
# kinds whose "none" choice means "feature off" (no implementation object)
OPTIONAL_KINDS = ("drafter", "quant", "grammar", "tracker")

_plugin_manager: pluggy.PluginManager | None = None


class UnknownPluginError(ValueError):
    """An unknown plugin name; the message lists the valid choices."""


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use with all entry points loaded."""
    global _plugin_manager
    if _plugin_manager is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        _plugin_manager = pm
    return _plugin_manager


@contextlib.contextmanager
def registered(plugin: object, name: str | None = None) -> Iterator[object]:
    """Register ``plugin`` (a module or object with ``@hookimpl`` methods) for a ``with`` block."""
    pm = plugin_manager()
    pm.register(plugin, name=name)
    try:
        yield plugin
    finally:
        pm.unregister(plugin)


def available(kind: str) -> dict[str, type]:
    """All implementations registered for ``kind`` (name -> class), in registration order.

    Raises:
        KeyError: for an unknown kind (the valid kinds are listed).
        TypeError: when a plugin registers a class that does not subclass the kind's ABC, or
            registers one name twice with different classes.
    """
    if kind not in KINDS:
        raise KeyError(f"unknown plugin kind {kind!r}; kinds are {sorted(KINDS)}")
    hook_name, base, _ = KINDS[kind]
    found: dict[str, type] = {}

    def register(name: str, cls: type) -> None:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{kind} plugin {name!r} must subclass {base.__name__}, got {cls!r}")
        if name in found and found[name] is not cls:
            raise TypeError(f"{kind} name {name!r} registered twice ({found[name]!r} and {cls!r})")
        found[name] = cls

    getattr(plugin_manager().hook, hook_name)(register=register)
    return found


def choices(kind: str) -> list[str]:
    """Valid names for ``kind``, sorted; optional kinds include ``none``."""
    names = sorted(available(kind))
    return (["none"] + names) if kind in OPTIONAL_KINDS else names


def get_class(kind: str, name: str) -> type | None:
    """The class registered as ``name`` for ``kind``; ``None`` for ``none`` of an optional kind.

    Raises:
        UnknownPluginError: for an unknown name, listing the valid choices.
    """
    if name == "none" and kind in OPTIONAL_KINDS:
        return None
    impls = available(kind)
    if name not in impls:
        group = KINDS[kind][2] if kind in KINDS else kind
        raise UnknownPluginError(
            f"unknown {kind} {name!r}; valid choices: {', '.join(choices(kind))} "
            f"(set {group}=<one of them>, or install the package that provides {name!r})")
    return impls[name]


def create(kind: str, name: str, **params: Any) -> Any:
    """Instantiate implementation ``name`` of ``kind`` with ``params``; ``None`` for ``none``.

    Raises:
        UnknownPluginError: for an unknown name.
    """
    cls = get_class(kind, name)
    return None if cls is None else cls(**params)
