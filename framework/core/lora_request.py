"""``LoRARequest``: which LoRA adapter a request runs under (vLLM's ``vllm.lora.request.LoRARequest``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter, named by the caller; requests carrying equal ``lora_int_id`` share its weights.

    ``lora_path`` is a folder as PEFT's ``save_pretrained`` writes it (``adapter_config.json`` and
    ``adapter_model.safetensors``); it is read on the driver when the first request naming the adapter
    arrives (checks, ``framework/model_executor/lora_adapter.py``) and by each rank when it first needs the
    weights (``framework/model_executor/lora_layers.py``).

    Raises:
        ValueError: ``lora_int_id < 1`` (0 and negatives are reserved for "no adapter", as in vLLM) or an
            empty name or path.
    """

    lora_name: str  # the caller's name for the adapter (the OpenAI ``model`` field, in vLLM)
    lora_int_id: int  # >= 1; the adapter's identity in the engine: its cache key and prefix-cache salt
    lora_path: str  # PEFT adapter folder

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1 (0 means no adapter), got {self.lora_int_id}")
        if not self.lora_name or not self.lora_path:
            raise ValueError("LoRARequest needs a lora_name and a lora_path (a PEFT adapter folder)")


def named_lora_request(name: str, modules: dict[str, str]) -> LoRARequest:
    """The :class:`LoRARequest` of adapter ``name`` among the run's ``lora.modules`` (name -> PEFT folder; vLLM's
    ``--lora-modules``): its ``lora_int_id`` is its 1-based place in the sorted names, so one name is one adapter
    for the whole run.

    Raises:
        ValueError: ``name`` is not in ``modules`` (the message lists the known names and the override to add).
    """
    if name not in modules:
        known = ", ".join(sorted(modules)) or "none"
        raise ValueError(f"LoRA adapter {name!r} is not in lora.modules (known: {known}); add "
                         f"+lora.modules.{name}=<PEFT adapter folder> (and lora.enable=true)")
    return LoRARequest(name, sorted(modules).index(name) + 1, str(modules[name]))

