"""Multi-LoRA at the engine level: what ``lora.enable=true`` refuses before weights load, what it turns off, and the
driver's admission check of each request's adapter (docs/lora.md).

This slice of multi-LoRA serving (issue 59) runs offline, on one rank in the driver's process (``executor=uniproc``)
or on tensor-parallel ranks (``executor=mp``: A and B sharded as vLLM shards them), eagerly or compiled
(``engine.compile=true``: the LoRA term is an opaque op in the layer graphs), simulated (``executor=sim``: adapter
loads and LoRA FLOPs in the step model), over data-parallel replicas, with unfused linears, with any drafter, and
over a weight-only quantized base (``LORA_QUANT_METHODS``); every other
combination is refused here with the setting that fixes it, before any weights load (``framework/engine/builder.py``,
``validate_plugins``).
"""

from __future__ import annotations

import dataclasses
import logging

from framework.config import EngineConfig
from framework.core.lora_request import LoRARequest
from framework.model_executor.lora_adapter import load_adapter, module_shapes, read_adapter_config
from framework.model_executor.model_loader import load_model_config

logger = logging.getLogger(__name__)
_NOT_YET = "not supported with lora.enable=true yet (issue 59: multi-LoRA serving)"
#: quant methods whose (weight-only) quantized linears LoRA wraps: the LoRA term joins their float output
LORA_QUANT_METHODS = ("none", "int8_wo", "int4_wo", "gptq", "awq", "compressed_tensors")


def lora_problems(config: EngineConfig) -> list[str]:
    """Why ``config`` cannot serve LoRA adapters (empty: it can, or LoRA is off); each problem names its fix.

    Checked: ``executor=uniproc``, ``mp`` or ``sim`` (each data-parallel replica its own), a quant method of
    :data:`LORA_QUANT_METHODS` (weight-only: the LoRA term is added to the quantized linear's output in the compute
    dtype, vLLM's rule; a compressed-tensors checkpoint's schemes must not quantize input activations) on one rank,
    no insisted-on CUDA graphs, a KV allocator whose prefix cache is salted with the
    adapter (``paged``; ``contiguous`` shares nothing) or prefix caching off, and each ``lora.modules`` folder's
    ``adapter_config.json`` (rank within ``max_lora_rank``).

    Any drafter is accepted: drafts are only proposals, and the target verifies them in a forward that applies
    each request's adapter (vLLM's rule for LoRA with speculative decoding), so greedy outputs equal the adapter's
    own. ``ngram`` reads tokens only; ``draft_model`` proposes with its base draft model (no adapter); ``eagle`` and
    ``medusa`` read the target's hidden states, which carry the adapter, through heads trained on the base model,
    so they accept less under an adapter that moves them far.
    """
    if not config.enable_lora:
        return []
    rules = [
        (config.executor in ("uniproc", "mp", "sim"), f"executor={config.executor} is {_NOT_YET}; use "
         "executor=uniproc, executor=mp for tensor parallelism, or executor=sim"),
        (config.quant in LORA_QUANT_METHODS, f"a quantized base (quant={config.quant}) is {_NOT_YET}: LoRA wraps "
         f"weight-only quantized linears, one of {LORA_QUANT_METHODS[1:]}; use one of them or quant=none"),
        (config.quant == "none" or config.tensor_parallel_size == 1, f"a quantized base (quant={config.quant}) "
         f"under tensor parallelism is {_NOT_YET}; use parallel.tensor_parallel_size=1 or quant=none"),
        (config.enforce_eager is not False, f"decode CUDA graphs (engine.enforce_eager=false) are {_NOT_YET}; "
         "use engine.enforce_eager=null or true"),
        (config.kv_allocator in ("paged", "contiguous") or not config.enable_prefix_caching,
         f"kv_cache={config.kv_allocator} does not key its prefix cache by adapter, {_NOT_YET}; use kv_cache=paged "
         "or engine.enable_prefix_caching=false"),
    ]
    if config.quant == "compressed_tensors" and _quantized_activations(config):
        rules.append((False, f"a compressed-tensors checkpoint with quantized input activations (W8A8, FP8) under "
                             f"LoRA is {_NOT_YET}: LoRA wraps weight-only layers; use a pack-quantized (W4A16, W8A16) "
                             f"checkpoint or lora.enable=false"))
    problems = [message for ok, message in rules if not ok]
    for name, path in config.lora_modules.items():
        try:
            read_adapter_config(LoRARequest(name, 1, str(path)), config.max_lora_rank)
        except ValueError as e:
            problems.append(f"lora.modules.{name}: {e}")
    return problems


def _quantized_activations(config: EngineConfig) -> bool:
    """Whether the checkpoint's compressed-tensors ``config_groups`` quantize any layer's input activations."""
    from framework.model_executor.quantized_checkpoint import quantization_config

    try:
        qc = quantization_config(load_model_config(config.model)) or {}
    except (OSError, ValueError):  # a missing model is reported by the model checks
        return False
    return any(group.get("input_activations") for group in (qc.get("config_groups") or {}).values())


def resolve_lora_defaults(config: EngineConfig) -> EngineConfig:
    """With LoRA on, the ``auto`` choices that would compile the wrapped linears or capture CUDA graphs resolve to
    their off setting (logged with the reason): ``compile=auto`` -> ``false`` (``true`` compiles: asked for
    explicitly), ``enforce_eager=None`` -> ``True``. ``prepack_linears`` stays as set: the base GEMMs keep oneDNN's
    packed weights and the fused q/k/v and gate/up, whose parts LoRA wraps in one rank block each
    (``framework/model_executor/lora_layers.py``; unpacked and unfused, a 64-request bf16 SmolLM2 decode step with 4
    adapters took 185.9 ms, 1.8x the base's). ``config`` unchanged when LoRA is off."""
    if not config.enable_lora:
        return config
    changes = {}
    if config.compile == "auto":
        changes["compile"] = "false"
    if config.enforce_eager is None:
        changes["enforce_eager"] = True
    if changes:
        logger.info("lora.enable=true: %s (LoRA-wrapped linears run eagerly unless "
                    "engine.compile=true, in this slice, issue 59)",
                    ", ".join(f"{k}={v}" for k, v in changes.items()))
    return dataclasses.replace(config, **changes)


class LoRAAdmission:
    """The driver's check of each request's adapter, before it is queued: the first request naming an adapter
    reads and checks it (:func:`framework.model_executor.lora_adapter.load_adapter` against ``config.json``'s
    shapes; under ``executor=sim``, which loads no weights, its ``adapter_config.json`` only); later ones reuse the
    verdict.

    Args:
        config: the engine's config (``enable_lora``, ``max_lora_rank``, ``model``).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.enabled = config.enable_lora
        self._config_only = config.executor == "sim"  # a simulated run reads no weights: adapter_config.json only
        self.max_lora_rank = config.max_lora_rank
        self._model = config.model
        self._shapes: dict[str, tuple[int, int]] | None = None
        self._checked: dict[int, LoRARequest] = {}  # lora_int_id -> the adapter it was checked as

    def check(self, lora_request: LoRARequest | None) -> None:
        """Accept ``lora_request`` (``None``: the base model, always accepted).

        Raises:
            ValueError: LoRA is off; an id already used for another name or folder; an adapter that does not load
                or does not fit the base model (missing or corrupt files, rank above ``max_lora_rank``, a module the
                model does not have, shapes of another model). Nothing is queued.
        """
        if lora_request is None:
            return
        if not self.enabled:
            raise ValueError("this request names a LoRA adapter but LoRA is off; build the engine with "
                             "LLM(..., enable_lora=True) or lora.enable=true")
        seen = self._checked.get(lora_request.lora_int_id)
        if seen is not None:
            if (seen.lora_name, seen.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} already names adapter {seen.lora_name!r} "
                                 f"({seen.lora_path}); give each adapter its own lora_int_id")
            return
        if self._config_only:
            read_adapter_config(lora_request, self.max_lora_rank)
        else:
            if self._shapes is None:
                self._shapes = module_shapes(load_model_config(self._model))
            load_adapter(lora_request, self._shapes, self.max_lora_rank)
        self._checked[lora_request.lora_int_id] = lora_request
