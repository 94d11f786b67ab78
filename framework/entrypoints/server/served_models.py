"""Which models a server serves: the base model under its served name and each LoRA adapter under its own
(vLLM's ``OpenAIServingModels``, ``vllm/entrypoints/openai/serving_models.py``).

The OpenAI ``model`` field picks one: the served name runs the base model, an adapter's name runs that adapter
(``LoRARequest``), anything else is vLLM's 404 (``{"error": {"message": "The model `X` does not exist.",
"type": "NotFoundError", "param": null, "code": 404}}``). Adapters come from ``lora.modules`` at start (their
``lora_int_id`` is their place in the sorted names, as offline runs number them) and, with
``lora.allow_runtime_updates=true``, from ``POST /v1/load_lora_adapter`` at run time (ids counting on from there,
never reused, so an engine that cached an adapter under an id never sees that id name another folder).
Unloading forgets the name; requests already running under it finish, and the engine's caches (``max_cpu_loras``
LRU) drop its weights when other adapters need the room.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from framework.core.lora_request import LoRARequest, named_lora_request
from framework.entrypoints.server.serving import RequestError, model_not_found
from framework.model_executor.lora_adapter import load_adapter, module_shapes
from framework.model_executor.model_loader import load_model_config

NOT_FOUND = "NotFoundError"  # vLLM's error ``type`` of an unknown model or adapter


class ServedModels:
    """The served names: the base model's and the loaded adapters' (see the module docstring).

    Args:
        base_name: the base model's served name (``server.served_model_name``, else the model path).
        base_root: the base model's folder (``root`` of its model card).
        max_model_len: prompt + output cap, tokens (every card's ``max_model_len``).
        enable_lora: the engine serves adapters (``lora.enable``); else every load is refused.
        lora_modules: adapter name -> PEFT folder, served from the start (``lora.modules``; ignored with LoRA off).
        max_lora_rank: the largest adapter rank the engine accepts (a load above it is a 400).
        allow_runtime_updates: ``lora.allow_runtime_updates``: the load/unload endpoints work.
    """

    def __init__(self, base_name: str, base_root: str, max_model_len: int, enable_lora: bool = False,
                 lora_modules: dict[str, str] | None = None, max_lora_rank: int = 16,
                 allow_runtime_updates: bool = False) -> None:
        self.base_name, self.base_root, self.max_model_len = base_name, base_root, max_model_len
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self.allow_runtime_updates = allow_runtime_updates
        # lora.modules without lora.enable: nothing to serve them with, so they are not listed (requests naming them 404)
        modules = {str(k): str(v) for k, v in (lora_modules or {}).items()} if enable_lora else {}
        self.adapters: dict[str, LoRARequest] = {name: named_lora_request(name, modules) for name in sorted(modules)}
        self._ids = itertools.count(len(modules) + 1)
        self._lock = asyncio.Lock()
        self._shapes: dict[str, tuple[int, int]] | None = None

    @classmethod
    def from_config(cls, base_name: str, config: Any, max_model_len: int) -> ServedModels:
        """The served models of an ``EngineConfig`` (``model``, ``enable_lora``, ``lora_modules``,
        ``max_lora_rank``, ``allow_runtime_lora_updates``)."""
        return cls(base_name, str(config.model), max_model_len, enable_lora=config.enable_lora,
                   lora_modules=config.lora_modules, max_lora_rank=config.max_lora_rank,
                   allow_runtime_updates=config.allow_runtime_lora_updates)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter the ``model`` field names; ``None`` for the base model (or no ``model`` field).

        Raises:
            RequestError(404): vLLM's "The model `X` does not exist." for any other name.
        """
        if model is None or model == self.base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    def cards(self) -> list[dict[str, Any]]:
        """``GET /v1/models``' ``data``: vLLM's ``ModelCard`` of the base model (``parent`` null) and of each
        adapter (``root``: its folder, ``parent``: the base model's served name)."""
        def card(model_id: str, root: str, parent: str | None) -> dict[str, Any]:
            return {"id": model_id, "object": "model", "created": 0, "owned_by": "servelab", "root": root,
                    "parent": parent, "max_model_len": self.max_model_len}

        return [card(self.base_name, self.base_root, None)] + [
            card(name, adapter.lora_path, self.base_name) for name, adapter in self.adapters.items()]

    def _check_updates(self) -> None:
        if not self.allow_runtime_updates:
            raise RequestError("runtime LoRA adapter updates are off on this server; start it with "
                               "lora.allow_runtime_updates=true (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
                               404, kind=NOT_FOUND, code=404)
        if not self.enable_lora:
            raise RequestError("this server serves no LoRA adapters (lora.enable=false); start it with "
                               "lora.enable=true", 400)

    async def load(self, lora_name: str | None, lora_path: str | None) -> str:
        """``POST /v1/load_lora_adapter``: read and check the PEFT folder against the base model (off the event
        loop), then serve it as ``lora_name``; returns vLLM's success text.

        Raises:
            RequestError(404): runtime updates are off (the message names ``lora.allow_runtime_updates=true``).
            RequestError(400): LoRA is off; a missing name or path; a name already served (the base model's
                included); a folder that does not load or fit the base model (missing or corrupt files, a rank
                above ``max_lora_rank``, modules or shapes of another model: the checks of
                :func:`~framework.model_executor.lora_adapter.load_adapter`). Nothing changes then.
        """
        self._check_updates()
        if not lora_name or not lora_path:
            raise RequestError("Both 'lora_name' and 'lora_path' must be provided.", 400)
        async with self._lock:
            if lora_name in self.adapters or lora_name == self.base_name:
                raise RequestError(f"The lora adapter '{lora_name}' has already been loaded.", 400)
            adapter = LoRARequest(lora_name, next(self._ids), str(lora_path))
            try:
                await asyncio.to_thread(self._check_folder, adapter)
            except (ValueError, OSError) as exc:
                raise RequestError(f"cannot load LoRA adapter '{lora_name}' from {lora_path}: {exc}", 400) from exc
            self.adapters[lora_name] = adapter
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    async def unload(self, lora_name: str | None) -> str:
        """``POST /v1/unload_lora_adapter``: stop serving ``lora_name``; returns vLLM's success text.

        Raises:
            RequestError(404): runtime updates are off, or no adapter of that name is served (vLLM's message).
            RequestError(400): LoRA is off, or no ``lora_name``.
        """
        self._check_updates()
        if not lora_name:
            raise RequestError("'lora_name' needs to be provided to unload a LoRA adapter.", 400)
        async with self._lock:
            if self.adapters.pop(lora_name, None) is None:
                raise RequestError(f"The lora adapter '{lora_name}' cannot be found.", 404, kind=NOT_FOUND, code=404)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    def _check_folder(self, adapter: LoRARequest) -> None:
        """Read the adapter's files and check them against the base model's ``config.json`` shapes."""
        if self._shapes is None:
            self._shapes = module_shapes(load_model_config(self.base_root))
        load_adapter(adapter, self._shapes, self.max_lora_rank)
