"""``build_engine``: from an :class:`~framework.config.EngineConfig` to a running :class:`LLMEngine`.

The steps, in the order they run (each a function below, so a reader can follow one at a time):

1. :func:`validate_plugins` — every plugin name resolves (before anything is read from disk), then
   :func:`resolve_dtype` turns ``dtype="auto"`` into the checkpoint's dtype (``config.json`` only) and
   each class's ``validate(config)`` passes (device, dtype, block size...).
2. :func:`inspect_model` — ``config.json`` only: refuse pre-quantized checkpoints, resolve
   ``max_model_len``, read the attention shape (:class:`ModelSpec`) and let the attention backend
   refuse a model it cannot run — still before any weights load.
3. :func:`load_weights` — load the transformers model and tokenizer, apply the quant method and
   prepack CPU linears.
4. :func:`make_attention_backend` — the backend instance for the model's heads and the cache dtype.
5. :func:`plan_kv_cache` — which layers share a block table (KV cache groups: sliding-window layers
   get their own when the allocator can release their out-of-window blocks), then
   :func:`size_kv_cache` — how many KV blocks the budget holds (at least one ``max_model_len`` request).
6. :func:`make_scheduler` — KV allocator, scheduler policy, swap space, stop checker.
7. :func:`make_runner` — the model runner (KV tensors, sampler; ``engine.compile=true``: the
   ``torch.compile`` warm-up; ``auto`` compiles later, in ``LLMEngine.maybe_compile``).
8. :func:`attach_structured_output`, :func:`attach_drafter` — grammar engine and drafter, if chosen.
9. :func:`assemble` — the engine, its metrics' KV info, the ``on_engine_start`` hook.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from framework import registry
from framework.config import PLUGIN_FIELDS, EngineConfig
from framework.core.kv_cache_groups import KVCacheLayout, make_kv_cache_groups
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.core.structured_output import StructuredOutputManager
from framework.core.swap import SwapSpace
from framework.engine.llm_engine import LLMEngine
from framework.interfaces import AttentionBackend, AttentionLayerSpec, Drafter
from framework.metrics.collector import MetricsCollector
from framework.worker.cpu_malloc import tune_malloc
from framework.worker.forward_context import register_attention_implementation
from framework.worker.model_loader import LoadedModel
from framework.worker.model_runner import ModelRunner
from framework.worker.prepack import prepack_linears, should_prepack
from framework.worker.sampler import Sampler

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8,
                                                   "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class ModelSpec:
    """What the engine must know about a model before its weights load (read from ``config.json``)."""

    hf_config: Any  # transformers PretrainedConfig
    max_model_len: int  # prompt + output cap, tokens
    num_layers: int  # decoder layers (one KV cache tensor each)
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key/value heads per layer
    head_size: int  # channels per head of the KV cache (max of the key and value head sizes)
    vocab_size: int  # logits columns
    attention_layers: list[AttentionLayerSpec]  # per layer: heads, head sizes, window, softcap, sinks


def build_engine(config: EngineConfig, metrics: MetricsCollector | None = None) -> LLMEngine:
    """Validate plugins, inspect and load the model, size the KV cache and assemble the engine.

    Args:
        config: the engine's configuration; ``dtype="auto"`` is resolved first, and the engine keeps
            the resolved copy (``engine.config``).
        metrics: collector of step/request metrics (e.g. with goodput SLOs); default a plain one.

    Raises:
        registry.UnknownPluginError, ValueError: from :func:`validate_plugins` or
            :func:`inspect_model` (before any weights load), or a KV budget smaller than one
            ``max_model_len`` request (:func:`size_kv_cache`).
        FileNotFoundError, ModuleNotFoundError: the model cannot be found (:func:`resolve_dtype`).
    """
    validate_plugins(config)
    if config.dtype == "auto":
        config = resolve_dtype(config)
        logger.info("dtype=auto: %s (the checkpoint's config.json)", config.dtype)
    spec = inspect_model(config)
    loaded = load_weights(config)
    backend = make_attention_backend(config, loaded.model, spec, loaded.kv_cache_dtype)
    layout = plan_kv_cache(config, spec)
    num_blocks = size_kv_cache(config, backend, spec, layout)
    scheduler = make_scheduler(config, spec, backend, num_blocks, loaded.tokenizer, layout)
    runner = make_runner(config, loaded.model, spec, backend, num_blocks, layout)
    structured = attach_structured_output(config, runner, loaded, spec)
    drafter = attach_drafter(config, runner, loaded)
    return assemble(config, scheduler, runner, loaded, spec, structured, drafter, metrics)


def resolve_dtype(config: EngineConfig) -> EngineConfig:
    """Step 1b: ``dtype="auto"`` -> the checkpoint's dtype (``config.json``'s ``dtype``, float32 when it
    names none), as vLLM's ``dtype="auto"``: SmolLM2's folder runs in bfloat16, stories260K in float32.
    Transformers parity is checked in float32: ask for it with ``dtype="float32"``.

    Returns:
        ``config`` itself when its dtype is explicit, else a copy with the checkpoint's dtype.

    Raises:
        FileNotFoundError, ModuleNotFoundError: the model cannot be found (see ``resolve_model_path``).
    """
    if config.dtype != "auto":
        return config
    from framework.worker.model_loader import checkpoint_dtype, load_model_config

    return dataclasses.replace(config, dtype=checkpoint_dtype(load_model_config(config.model)))


def validate_plugins(config: EngineConfig) -> list[type | None]:
    """Step 1: resolve every plugin name, then (with ``dtype="auto"`` resolved from ``config.json``)
    run each class's capability check, before any weights load.

    Returns:
        The class chosen for each kind of ``PLUGIN_FIELDS`` (``None`` for ``none``).

    Raises:
        registry.UnknownPluginError: an unknown name (lists the valid choices).
        ValueError: a plugin that cannot run here or with this config (each problem names a fix).
    """
    classes = [registry.get_class(kind, getattr(config, kind)) for kind in PLUGIN_FIELDS]  # names first
    config = resolve_dtype(config)
    problems: list[str] = []
    for cls in classes:
        if cls is not None:
            problems += cls.validate(config)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"device={config.device!r} but CUDA is not available; use device=cpu")
    if problems:
        raise ValueError("cannot build the engine:\n  - " + "\n  - ".join(problems))
    return classes


def refuse_prequantized(model_config: Any) -> None:
    """Refuse a pre-quantized (GPTQ/AWQ/compressed-tensors...) checkpoint before its weights load.

    None of transformers' quantizer back ends for these formats is installed or verified here (they
    need CUDA kernels or extra packages: gptqmodel, autoawq, compressed-tensors), so servelab loads
    only unquantized checkpoints and quantizes them itself with ``quant=<method>``.

    Raises:
        ValueError: the config carries a ``quantization_config`` (names its ``quant_method``).
    """
    qc = getattr(model_config, "quantization_config", None)
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc)
        raise ValueError(f"pre-quantized checkpoints are not supported (this one is {method!s}): transformers' "
                         "quantizer for it needs kernels not available here; load the unquantized model and "
                         "use quant=int8_wo|int4_wo|w8a8|fp8 instead")


def inspect_model(config: EngineConfig) -> ModelSpec:
    """Step 2: read ``config.json``, resolve ``max_model_len``, describe each layer's attention
    (``framework.worker.model_families.attention_layers``) and let the backend refuse the model.

    Raises:
        ValueError: a pre-quantized checkpoint, ``max_model_len`` above the model's
            ``max_position_embeddings``, an architecture servelab cannot run exactly
            (``UnsupportedModelError``: encoder-decoder, non-causal, attention outside transformers'
            interface, unknown layer types), or a model the attention backend cannot run (the error
            names the backends that can).
    """
    from framework.worker.model_families import attention_layers, family_of
    from framework.worker.model_loader import load_model_config

    mc = load_model_config(config.model)
    refuse_prequantized(mc)
    max_pos = int(getattr(mc, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or max_pos
    if max_pos and max_model_len > max_pos:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}")
    layers = attention_layers(mc)
    if family_of(mc.model_type) is None:
        logger.warning("model_type %r is not among the families servelab tests (servelab models); its attention "
                       "calls are checked against config.json, the rest of the model is transformers' own",
                       mc.model_type)
    spec = ModelSpec(hf_config=mc, max_model_len=max_model_len, num_layers=mc.num_hidden_layers,
                     num_heads=layers[0].num_heads, num_kv_heads=layers[0].num_kv_heads,
                     head_size=max(layer.cache_head_size for layer in layers), vocab_size=mc.vocab_size,
                     attention_layers=layers)
    problems = registry.get_class("attention", config.attention).validate_model(layers, config)
    if problems:
        capable = backends_that_can_run(layers, config)
        if capable:
            problems.append(f"attention backends that can run this model: {', '.join(capable)}")
        raise ValueError("cannot build the engine:\n  - " + "\n  - ".join(problems))
    return spec


def backends_that_can_run(layers: list[AttentionLayerSpec], config: EngineConfig | None = None) -> list[str]:
    """Registered attention backends whose ``validate_model`` accepts ``layers`` (``"(CUDA)"`` marks GPU-only
    ones), for error messages and ``servelab models``."""
    names = []
    for name, cls in registry.available("attention").items():
        try:
            ok = not cls.validate_model(layers, config)
        except Exception:  # noqa: BLE001 - a third-party check that cannot judge without its config
            ok = False
        if ok:
            names.append(f"{name} (CUDA)" if cls.requires_cuda else name)
    return names


@dataclass
class LoadedWeights(LoadedModel):
    """A :class:`LoadedModel` after the quant method and prepacking ran."""

    kv_cache_dtype: torch.dtype | None = None  # what the quant method asks of the KV cache (None: model dtype)


def load_weights(config: EngineConfig) -> LoadedWeights:
    """Step 3: load model and tokenizer (attention routed to servelab), quantize, prepack CPU linears."""
    from framework.worker.model_loader import load_model

    device = torch.device(config.device)
    if config.tune_malloc and device.type == "cpu":
        tune_malloc()
    loaded = load_model(config.model, dtype=config.dtype, device=config.device,
                        attn_implementation=register_attention_implementation())
    model, dtype = loaded.model, getattr(torch, config.dtype)
    quant = registry.create("quant", config.quant, **config.plugin_params("quant"))
    if quant is not None:
        model = quant.apply(model)
    if should_prepack(config.prepack_linears, device, dtype, config.compile_freezing):
        num_gemms = prepack_linears(model, compiled=config.compile == "true")  # auto: unfused if compiled later
        logger.info("prepack_linears: %d GEMMs prepacked for oneDNN", num_gemms)
    return LoadedWeights(model=model, tokenizer=loaded.tokenizer, config=loaded.config,
                         eos_token_ids=loaded.eos_token_ids, max_model_len=loaded.max_model_len, path=loaded.path,
                         kv_cache_dtype=quant.kv_cache_dtype(dtype) if quant is not None else None)


def make_attention_backend(config: EngineConfig, model: torch.nn.Module, spec: ModelSpec,
                           quant_kv_dtype: torch.dtype | None) -> AttentionBackend:
    """Step 4: the backend for the model's layers (``spec.attention_layers``); its default softmax scale
    is the first attention module's ``scaling`` (``head_size ** -0.5`` when it has none; a layer that
    differs passes its own with each call); the cache dtype is ``engine.kv_cache_dtype``, else what the
    quant method asks, else the model dtype."""
    kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or quant_kv_dtype or getattr(torch, config.dtype)
    scale = next((float(m.scaling) for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")),
                 spec.attention_layers[0].head_size ** -0.5)
    return registry.create("attention", config.attention, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                           head_size=spec.head_size, scale=scale, block_size=config.block_size, dtype=kv_dtype,
                           device=torch.device(config.device), layers=spec.attention_layers,
                           **config.plugin_params("attention"))


def plan_kv_cache(config: EngineConfig, spec: ModelSpec) -> KVCacheLayout:
    """Step 5a: the KV cache groups (``framework/core/kv_cache_groups.py``). With an allocator that declares
    ``supports_kv_cache_groups`` (``paged``), each sliding window gets groups of its own whose
    out-of-window blocks are released; otherwise one group of every layer, logged when the model has
    sliding-window layers (correct, but no saving)."""
    windows = sorted({w for layer in spec.attention_layers if (w := layer.sliding_window)})
    release = registry.get_class("kv_allocator", config.kv_allocator).supports_kv_cache_groups
    layout = KVCacheLayout(make_kv_cache_groups(spec.attention_layers, release), spec.num_layers)
    if windows and not release:
        logger.warning("kv_cache=%s keeps every KV block of the sliding-window layers (window %s) for the whole "
                       "request (it does not declare supports_kv_cache_groups): correct, but without the "
                       "sliding-window memory saving; kv_cache=paged releases out-of-window blocks",
                       config.kv_allocator, ", ".join(map(str, windows)))
    elif windows:
        logger.info("KV cache groups: %s (%d layers per block); out-of-window blocks are released",
                    ", ".join(f"{len(g.layer_ids)} layers {'full' if g.sliding_window is None else g.sliding_window}"
                              for g in layout.groups), layout.layers_per_block)
    return layout


def size_kv_cache(config: EngineConfig, backend: AttentionBackend, spec: ModelSpec, layout: KVCacheLayout) -> int:
    """Step 5b: KV blocks of the pool: ``num_blocks`` if set, else ``kv_cache_memory_bytes`` over one block's
    bytes (``layout.layers_per_block`` layers; the null block of a layout with sliding groups comes out of
    the budget).

    Raises:
        ValueError: the cache cannot hold one ``max_model_len`` request (names the knobs to raise).
    """
    bytes_per_block = backend.kv_cache_bytes_per_block(layout.layers_per_block)
    num_blocks = config.num_blocks or config.kv_cache_memory_bytes // bytes_per_block - layout.has_null_block
    chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or config.max_num_batched_tokens)
    needed = layout.max_blocks_per_request(spec.max_model_len, config.block_size, chunk)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache holds {num_blocks} blocks x {config.block_size} tokens, fewer than one "
            f"max_model_len={spec.max_model_len} request needs ({needed} blocks); raise kv_cache_memory_bytes/"
            "num_blocks or lower max_model_len")
    return num_blocks


def num_swap_blocks(config: EngineConfig, backend: AttentionBackend, layout: KVCacheLayout) -> int:
    """CPU swap-space blocks for ``preemption_mode=swap`` (``swap_space_bytes`` / block bytes), else 0."""
    if config.preemption_mode != "swap":
        return 0
    return config.swap_space_bytes // backend.kv_cache_bytes_per_block(layout.layers_per_block)


def make_scheduler(config: EngineConfig, spec: ModelSpec, backend: AttentionBackend, num_blocks: int,
                   tokenizer: Any, layout: KVCacheLayout) -> Scheduler:
    """Step 6: KV allocator (given the KV cache groups when it supports them) + scheduler policy +
    (swap preemption) swap space + stop checker."""
    params = config.plugin_params("kv_allocator")
    if registry.get_class("kv_allocator", config.kv_allocator).supports_kv_cache_groups:
        params["kv_cache_groups"] = layout.groups
    allocator = registry.create("kv_allocator", config.kv_allocator, num_blocks=num_blocks,
                                block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                max_model_len=spec.max_model_len, **params)
    policy = registry.create("scheduler", config.scheduler, **config.plugin_params("scheduler"))
    swap_space = SwapSpace(num_swap_blocks(config, backend, layout)) if config.preemption_mode == "swap" else None
    return Scheduler(policy, allocator, StopChecker(tokenizer), max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=spec.max_model_len,
                     long_prefill_token_threshold=config.long_prefill_token_threshold, swap_space=swap_space)


def make_runner(config: EngineConfig, model: torch.nn.Module, spec: ModelSpec, backend: AttentionBackend,
                num_blocks: int, layout: KVCacheLayout) -> ModelRunner:
    """Step 7: the model runner: KV tensors (shared by the KV cache groups), swap tensors, sampler and
    (``engine.compile=true``) the warmed-up graphs."""
    return ModelRunner(model, backend, num_blocks, spec.num_layers, backend.cache_dtype, torch.device(config.device),
                       Sampler(spec.vocab_size, seed=config.seed),
                       num_swap_blocks=num_swap_blocks(config, backend, layout),
                       compile=config.compile == "true", compile_freezing=config.compile_freezing,
                       kv_cache_layout=layout)


def attach_structured_output(config: EngineConfig, runner: ModelRunner, loaded: LoadedModel,
                             spec: ModelSpec) -> StructuredOutputManager | None:
    """Step 8a: the grammar engine (``grammar != none``), shared by the engine and the runner's bitmasks."""
    if config.grammar == "none":
        return None
    grammar = registry.create("grammar", config.grammar, tokenizer=loaded.tokenizer, vocab_size=spec.vocab_size,
                              eos_token_ids=loaded.eos_token_ids, **config.plugin_params("grammar"))
    runner.structured_output = StructuredOutputManager(grammar, spec.vocab_size)
    return runner.structured_output


def attach_drafter(config: EngineConfig, runner: ModelRunner, loaded: LoadedModel) -> Drafter | None:
    """Step 8b: the drafter (``spec_decode != none``), loaded after the target; EAGLE-style drafters
    make the runner keep the target's hidden states."""
    drafter = registry.create("drafter", config.drafter, **config.plugin_params("drafter"))
    if drafter is not None:
        drafter.load(model=runner.model, model_config=loaded.config, config=config)
        runner.keep_hidden_states = drafter.needs_hidden_states
    return drafter


def assemble(config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, loaded: LoadedModel, spec: ModelSpec,
             structured: StructuredOutputManager | None, drafter: Drafter | None,
             metrics: MetricsCollector | None) -> LLMEngine:
    """Step 9: the engine; records the KV cache's shape in its metrics and fires ``on_engine_start``."""
    engine = LLMEngine(config, scheduler, runner, loaded.tokenizer, loaded.eos_token_ids, spec.vocab_size, metrics,
                       structured, drafter)
    bytes_per_block = runner.block_bytes
    num_blocks = scheduler.kv.num_blocks
    groups = runner.kv_cache_layout.groups
    engine.metrics.kv_cache_info = {
        "kv_cache_dtype": config.kv_cache_dtype, "kv_cache_num_blocks": num_blocks,
        "kv_cache_bytes_per_block": bytes_per_block, "kv_cache_num_groups": len(groups),
        "kv_cache_layers_per_block": runner.kv_cache_layout.layers_per_block,
        "kv_cache_group_windows": " ".join("full" if g.sliding_window is None else str(g.sliding_window)
                                           for g in groups)}
    logger.info("engine ready: %d KV blocks (%.1f MiB, kv_cache_dtype=%s, %d bytes/block), max_model_len=%d",
                num_blocks, runner.kv_cache_bytes / 2**20, config.kv_cache_dtype, bytes_per_block,
                spec.max_model_len)
    registry.call_hook("on_engine_start", config=config.to_dict())
    return engine
