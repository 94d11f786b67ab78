"""Plugin registry: one pluggy ``PluginManager`` that loads the ``servelab.plugins`` entry points
(built-ins included) and maps ``(kind, name)`` to implementation classes."""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator
from importlib import metadata
from typing import Any

import pluggy

from framework import hookspecs
from framework.interfaces import (
    AttentionBackend,
    Drafter,
    Executor,
    Grammar,
    KVAllocator,
    KVConnector,
    LoRABackend,
    QuantMethod,
    Router,
    SchedulerPolicy,
    Tracker,
)
from framework.interfaces.base import INTERFACE_VERSION

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
    "executor": ("register_executors", Executor, "executor"),
    "router": ("register_routers", Router, "router"),
    "lora_backend": ("register_lora_backends", LoRABackend, "lora_backend"),
    "kv_connector": ("register_kv_connectors", KVConnector, "kv_connector"),
}
# kinds whose "none" choice means "feature off" (no implementation object)
OPTIONAL_KINDS = ("drafter", "quant", "grammar", "tracker", "kv_connector")

_plugin_manager: pluggy.PluginManager | None = None
_sources: dict[int, tuple[str, str]] = {}  # id(plugin object) -> (distribution, version) of entry-point plugins
_failed_hooks: set[tuple[str, str]] = set()  # (plugin name, hook) whose failure was logged with a traceback
_HOOK_LOCK = threading.RLock()  # one lifecycle hook call at a time (a hook may call another)
logger = logging.getLogger(__name__)


class UnknownPluginError(ValueError):
    """An unknown plugin name; the message lists the valid choices."""


class PluginConflictError(TypeError):
    """Two plugins (usually two packages) register the same name for one kind."""


class PluginVersionError(TypeError):
    """A plugin targets another plugin-interface version than this servelab provides."""


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Register every ``servelab.plugins`` entry point; one that fails to import only warns (naming its
    package and the error) so that the other plugins still load."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = (ep.dist.metadata["Name"], ep.dist.version) if ep.dist is not None else ("(unknown)", "")
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as e:  # noqa: BLE001 - any import error of a third-party package
            warnings.warn(f"servelab plugin {ep.name!r} from package {dist[0]} {dist[1]} failed to import "
                          f"({type(e).__name__}: {e}); its plugins are unavailable, the others still load",
                          RuntimeWarning, stacklevel=2)
            continue
        pm.register(plugin, name=ep.name)
        _sources[id(plugin)] = dist


def plugin_source(plugin: object) -> tuple[str, str]:
    """``(distribution, version)`` that provided a registered plugin object; ``("(runtime)", "")`` for
    plugins registered in-process (tests, trackers)."""
    return _sources.get(id(plugin), ("(runtime)", ""))


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use with all entry points loaded."""
    global _plugin_manager
    if _plugin_manager is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        pm.add_hookspecs(hookspecs)
        _load_entry_points(pm)
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


def call_hook(name: str, **kwargs: Any) -> None:
    """Call lifecycle hook ``name`` (``on_engine_start``, ``on_step_end``, ``on_request_finished``,
    ``on_run_end``) on every registered plugin, in pluggy's order, each one in isolation.

    pluggy stops at the first implementation that raises and re-raises in the caller; an observer's bug
    must neither kill the engine loop nor hide the hook from the other observers. So each implementation
    is called on its own; an exception is swallowed and logged once per plugin and hook (an error with the
    plugin's name and the traceback; later ones at debug level, so a hook failing every step does not
    flood the log). Hook wrappers are not supported for lifecycle hooks (they fail the same way). Calls are
    serialized process-wide (data-parallel replicas of one process step on threads of their own; observers such as
    trackers need not be thread-safe).
    """
    with _HOOK_LOCK:
        _call_hook(name, kwargs)


def _call_hook(name: str, kwargs: dict[str, Any]) -> None:
    for impl in reversed(getattr(plugin_manager().hook, name).get_hookimpls()):
        try:
            if impl.hookwrapper or impl.wrapper:
                raise TypeError("hook wrappers are not supported for lifecycle hooks")
            impl.function(**{arg: kwargs[arg] for arg in impl.argnames})
        except Exception:  # noqa: BLE001 - see the docstring
            key = (impl.plugin_name, name)
            log = logger.debug if key in _failed_hooks else logger.error
            _failed_hooks.add(key)
            log("lifecycle hook %s of plugin %r raised; the engine and the other plugins go on (logged once "
                "per plugin and hook)", name, impl.plugin_name, exc_info=True)


def available(kind: str) -> dict[str, type]:
    """All implementations registered for ``kind`` (name -> class), in registration order.

    Raises:
        KeyError: for an unknown kind (the valid kinds are listed).
        TypeError: when a plugin registers a class that does not subclass the kind's ABC.
        PluginConflictError: one name registered with two classes (the message names both packages).
        PluginVersionError: a class whose ``interface_version`` differs from ``INTERFACE_VERSION``.
    """
    if kind not in KINDS:
        raise KeyError(f"unknown plugin kind {kind!r}; kinds are {sorted(KINDS)}")
    hook_name, base, _ = KINDS[kind]
    found: dict[str, tuple[type, str]] = {}  # name -> (class, "package version")

    def check(name: str, cls: type, origin: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"{kind} plugin {name!r} from {origin} must subclass {base.__name__}, got {cls!r}")
        version = getattr(cls, "interface_version", INTERFACE_VERSION)
        if version != INTERFACE_VERSION:
            raise PluginVersionError(
                f"{kind} plugin {name!r} from {origin} targets servelab plugin interface v{version}, but this "
                f"servelab provides v{INTERFACE_VERSION}; upgrade the plugin package (or servelab) so they match")
        if name in found and found[name][0] is not cls:
            raise PluginConflictError(
                f"{kind} name {name!r} is registered twice: by {found[name][1]} ({found[name][0].__module__}."
                f"{found[name][0].__qualname__}) and by {origin} ({cls.__module__}.{cls.__qualname__}); "
                "uninstall one of the packages or rename one plugin")
        found[name] = (cls, origin)

    for impl in reversed(getattr(plugin_manager().hook, hook_name).get_hookimpls()):  # pluggy call order
        package, version = plugin_source(impl.plugin)
        origin = f"package {package} {version}".rstrip() if package != "(runtime)" else f"plugin {impl.plugin_name!r}"
        impl.function(register=lambda name, cls, origin=origin: check(name, cls, origin))
    return {name: cls for name, (cls, _) in found.items()}


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
