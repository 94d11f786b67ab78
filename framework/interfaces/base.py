"""Common base of every plugin class: a registry name and a pre-flight ``validate``."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from framework.config import EngineConfig

# Version of the plugin interfaces (hookspecs + the ABCs in framework.interfaces). Bumped on any
# incompatible change; a plugin class states the version it targets in ``interface_version`` and the
# registry refuses a mismatch with a clear error (see docs/plugins.md, "Versioning").
INTERFACE_VERSION = 1


class Plugin:
    """Base of all plugin ABCs.

    ``validate`` is a classmethod so that the registry can check a choice against the machine
    and the config before any model weights load.
    """

    name: ClassVar[str] = ""  # registry key; equals the module name and conf/<group>/<name>.yaml
    requires_cuda: ClassVar[bool] = False  # True for GPU-only kernels
    interface_version: ClassVar[int] = INTERFACE_VERSION  # plugin-interface version this class targets

    @classmethod
    def validate(cls, config: EngineConfig) -> list[str]:
        """Explain why this plugin cannot run with ``config`` on this machine.

        Called by ``framework.build_engine`` before the model loads.

        Returns:
            Human-readable problems, each naming the fix; empty when the plugin can run.
        """
        problems: list[str] = []
        if cls.requires_cuda:
            import torch

            if not torch.cuda.is_available():
                problems.append(f"{cls.name!r} needs a CUDA GPU but none is available; "
                                "choose a CPU-capable option (e.g. attention=torch)")
            elif not str(config.device).startswith("cuda"):
                problems.append(f"{cls.name!r} needs device=cuda, got device={config.device!r}")
        return problems
