"""Every built-in plugin module registers its classes through the hookspec of its kind, under the name the
class carries, and the names match the Hydra config group files (``plugins/<kind>/<name>.py`` ⇔ registry
key ⇔ ``conf/<group>/<name>.yaml``)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

from framework import registry

REPO = Path(__file__).resolve().parents[3]
PACKAGES = {"scheduler": "plugins.schedulers", "kv_allocator": "plugins.kv_allocators",
            "attention": "plugins.attention", "quant": "plugins.quant", "grammar": "plugins.grammars",
            "tracker": "plugins.trackers"}
HOOKS = {"register_schedulers", "register_kv_allocators", "register_attention_backends",
         "register_quant_methods", "register_grammars", "register_trackers"}


@pytest.mark.parametrize("kind", sorted(PACKAGES))
def test_builtin_modules_register_through_their_hookspec(kind):
    hook, base, group = registry.KINDS[kind]
    assert hook in HOOKS
    package = importlib.import_module(PACKAGES[kind])
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{PACKAGES[kind]}.{info.name}")
        impl = getattr(module, hook, None)
        assert impl is not None, f"{module.__name__} does not implement {hook}"
        impl(lambda name, cls: found.__setitem__(name, cls))
    assert found, f"no built-in {kind} plugin registered"
    for name, cls in found.items():
        assert issubclass(cls, base) and cls.name == name
        assert (REPO / "conf" / group / f"{name}.yaml").exists(), f"conf/{group}/{name}.yaml missing"
        assert registry.get_class(kind, name) is cls
