"""Where each registered plugin comes from: ``servelab plugins`` and the reproducibility record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework import registry


@dataclass(frozen=True)
class PluginInfo:
    """One registered implementation: kind, name, class path, providing distribution and capabilities."""

    kind: str
    name: str
    cls: str  # "module.Class"
    package: str  # distribution name (pip), or "(runtime)" for plugins registered in-process
    version: str
    devices: str  # "cpu, cuda" or "cuda"
    dtypes: str  # comma-separated torch dtypes, or "any" when the kind does not restrict them
    gpu_check: str = ""  # GPU kernels: how scripts/gpu_check.sh verifies it, or why it cannot


def _capabilities(cls: type) -> tuple[str, str]:
    devices = "cuda" if getattr(cls, "requires_cuda", False) else "cpu, cuda"
    dtypes = getattr(cls, "supported_dtypes", None)
    return devices, ", ".join(str(d).removeprefix("torch.") for d in dtypes) if dtypes else "any"


def list_plugins() -> list[PluginInfo]:
    """Every registered implementation of every kind, in kind order then registration order.

    Raises:
        TypeError: see :func:`framework.registry.available` (bad class, duplicate name).
    """
    pm = registry.plugin_manager()
    out = []
    for kind, (hook_name, _, _) in registry.KINDS.items():
        classes = registry.available(kind)  # validates subclassing / duplicates
        origin: dict[str, tuple[str, str]] = {}
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            names: list[str] = []
            impl.function(register=lambda name, cls, names=names: names.append(name))
            for name in names:
                origin.setdefault(name, registry.plugin_source(impl.plugin))
        for name, cls in classes.items():
            package, version = origin.get(name, ("(runtime)", ""))
            out.append(PluginInfo(kind, name, f"{cls.__module__}.{cls.__qualname__}", package, version,
                                  *_capabilities(cls), getattr(cls, "gpu_check", "")))
    return out


def chosen_plugin_sources(choices: dict[str, str]) -> dict[str, dict[str, Any]]:
    """``{kind: {"name", "package", "version", "class"}}`` for the chosen name of each kind
    (``none`` and unknown names are skipped); the reproducibility record stores it."""
    by_key = {(p.kind, p.name): p for p in list_plugins()}
    return {kind: {"name": name, "package": p.package, "version": p.version, "class": p.cls}
            for kind, name in choices.items() if (p := by_key.get((kind, name))) is not None}


def main(argv: list[str] | None = None) -> int:
    """``servelab plugins``: print a rich table of :func:`list_plugins`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="servelab plugins", header_style="bold")
    for column in ("kind", "name", "package", "version", "devices", "dtypes", "class", "GPU check"):
        table.add_column(column)
    for p in list_plugins():
        table.add_row(p.kind, p.name, p.package, p.version, p.devices, p.dtypes, p.cls, p.gpu_check)
    Console(width=200).print(table)
    return 0
