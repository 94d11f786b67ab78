"""``build_llm_engine``: from an :class:`~framework.config.EngineConfig` to one running :class:`LLMEngine` (one
data-parallel replica; ``framework.build_engine`` chooses the front over one or several).

The steps, in the order they run (each a function below, so a reader can follow one at a time):

1. :func:`validate_plugins` — every plugin name resolves (before anything is read from disk), then
   :func:`resolve_dtype` turns ``dtype="auto"`` into the dtype the checkpoint runs in here (``config.json``'s,
   float32 for a 16-bit checkpoint on a CPU without native 16-bit instructions: ``framework.platform``) and
   each class's ``validate(config)`` passes (device, dtype, block size, executor and rank count...).
2. :func:`inspect_model` — ``config.json`` only: refuse a pre-quantized checkpoint the quant method does not
   load, resolve
   ``max_model_len``, read each layer's attention (:class:`ModelSpec`), let the attention backend
   refuse a model it cannot run and refuse a tensor-parallel size the model cannot be split over
   (its plan, its heads, a rank's heads for the backend, the quant method's shards) — still
   before any weights load.
3. :func:`plan_kv_cache` — which layers share a block table (KV cache groups: sliding-window layers
   get their own when the allocator can release their out-of-window blocks).
4. :func:`make_executor` — the executor starts its worker ranks; each loads its model (its shard),
   applies the quant method, prepacks CPU linears and builds its attention backend and the same KV
   cache layout (``framework.worker.worker``). The driver loads only the tokenizer.
5. :func:`size_kv_cache` — how many KV blocks fit every rank (at least one ``max_model_len``
   request), then ``executor.initialize_cache`` allocates them and builds each rank's runner
   (``engine.compile=true``: the ``torch.compile`` warm-up; ``auto`` compiles later, in
   ``LLMEngine.maybe_compile``).
6. :func:`make_scheduler` — KV allocator, scheduler policy, swap space, stop checker (driver).
7. :func:`attach_structured_output`, :func:`attach_drafter` — grammar engine and drafter, if
   chosen, both on the driver.
8. :func:`assemble` — the engine, its metrics' KV info, the ``on_engine_start`` hook.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from framework import registry
from framework.config import PLUGIN_FIELDS, EngineConfig
from framework.core.clock import Clock
from framework.core.kv_cache_groups import KVCacheLayout, plan_kv_cache_layout
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.core.structured_output import StructuredOutputManager
from framework.core.swap import SwapSpace
from framework.engine.compile_control import RankZeroCompileStats
from framework.engine.kv_transfer_support import kv_transfer_problems, make_kv_transfer
from framework.engine.llm_engine import LLMEngine
from framework.engine.lora_support import lora_problems, resolve_lora_defaults
from framework.engine.spec_tree_support import acceptance_label, apply_acceptance, tree_problems
from framework.interfaces import AttentionLayerSpec, Drafter, Executor
from framework.metrics.collector import MetricsCollector
from framework.model_executor.embeddings import load_embeddings
from framework.model_executor.expert_parallel import ExpertParallelConfig, RankZeroExpertLoad, ep_problems
from framework.model_executor.model_families import attention_layers, family_of
from framework.model_executor.model_loader import checkpoint_dtype, load_model_config, load_tokenizer
from framework.model_executor.quantized_checkpoint import refuse_prequantized, resolve_checkpoint_quant
from framework.model_executor.tensor_parallel import rank_layout, shard_layer_specs, tp_problems
from framework.platform import DtypeChoice, choose_dtype

logger = logging.getLogger(__name__)
_SAID: set[str] = set()  # dtype decisions already logged by this process


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



def build_llm_engine(config: EngineConfig, metrics: MetricsCollector | None = None,
                     defer_compile: bool = False) -> LLMEngine:
    """Validate plugins, inspect the model, start the workers, size the KV cache and assemble one engine (one
    data-parallel replica; ``framework.build_engine`` puts several behind a front).

    Args:
        config: the engine's configuration (``data_parallel_size`` 1); ``dtype="auto"`` is resolved first
            (:func:`resolve_and_log_dtype`), and the engine keeps the resolved copy (``engine.config``).
        metrics: collector of step/request metrics (e.g. with goodput SLOs); default a plain one.
        defer_compile: ``engine.compile=true`` compiles at the engine's first ``maybe_compile`` instead
            of while the workers start (a server compiles while it answers ``/health`` with 503).

    Raises:
        registry.UnknownPluginError, ValueError: from :func:`validate_plugins` or
            :func:`inspect_model` (before any weights load), a KV budget smaller than one
            ``max_model_len`` request (:func:`size_kv_cache`), or ``data_parallel_size > 1``.
        FileNotFoundError, ModuleNotFoundError: the model cannot be found (:func:`dtype_choice`).
        WorkerError: a worker rank failed to start (its traceback in the message).
    """
    if config.data_parallel_size > 1:
        raise ValueError("build_llm_engine builds one replica; framework.build_engine (or LLM, run.py, servelab "
                         "serve) puts data_parallel_size replicas behind a router")
    config, choice = resolve_and_log_dtype(config)
    validate_plugins(config)
    config = resolve_lora_defaults(config)  # LoRA: compile/prepack/CUDA-graph "auto" choices resolve to off
    engine = _build_one(config, metrics, defer_compile)
    engine.metrics.model_info = {"dtype": choice.dtype, "dtype_reason": choice.reason, **acceptance_label(config)}
    return engine


def resolve_and_log_dtype(config: EngineConfig) -> tuple[EngineConfig, DtypeChoice]:
    """Step 1a: refuse unknown plugin names (before anything is read from disk), then resolve the dtype
    (:func:`dtype_choice`), logging the decision once per process (a warning when it is emulated), and the quant
    method of a pre-quantized checkpoint (``framework/model_executor/quantized_checkpoint.py``: ``quant=none``
    takes the method that loads the checkpoint's format; another method is refused).

    Returns:
        ``config`` with its dtype (and quant method) resolved, and the choice with its reason (``metrics.json``).

    Raises:
        registry.UnknownPluginError: an unknown plugin name.
        FileNotFoundError, ModuleNotFoundError: the model cannot be found.
    """
    for kind in PLUGIN_FIELDS:
        registry.get_class(kind, getattr(config, kind))
    choice = dtype_choice(config)
    if choice.reason not in _SAID:  # once per process (not again for each data-parallel replica)
        _SAID.add(choice.reason)
        if choice.emulated:
            logger.warning("%s", choice.reason)
        elif config.dtype == "auto":
            logger.info("%s", choice.reason)
    try:
        model_config = load_model_config(config.model)
    except (OSError, ValueError, ModuleNotFoundError):  # a missing model is reported by the model checks
        model_config = None
    quant = resolve_checkpoint_quant(config, model_config) if model_config is not None else config.quant
    return dataclasses.replace(config, dtype=choice.dtype, quant=quant), choice


def _build_one(config: EngineConfig, metrics: MetricsCollector | None, defer_compile: bool) -> LLMEngine:
    """Steps 2-8 for one replica (``config.dtype`` resolved, plugins validated)."""
    spec = inspect_model(config)
    layout = plan_kv_cache(config, spec)
    tokenizer, eos_token_ids = load_tokenizer(config.model, config.tokenizer)
    # the workers compile at start-up only for compile=true; deferred, they stay eager until maybe_compile
    executor = make_executor(dataclasses.replace(config, compile="auto")
                             if defer_compile and config.compile == "true" else config)
    try:
        num_blocks, num_swap_blocks = size_kv_cache(config, executor, spec, layout)
        executor.initialize_cache(num_blocks, num_swap_blocks)
        scheduler = make_scheduler(config, spec, num_blocks, num_swap_blocks, tokenizer, layout, executor.clock)
        structured = attach_structured_output(config, tokenizer, eos_token_ids, spec)
        drafter = attach_drafter(config, executor, spec)
        return assemble(config, scheduler, executor, tokenizer, eos_token_ids, spec, layout, structured, drafter,
                        metrics)
    except BaseException:
        executor.shutdown()
        raise


def dtype_choice(config: EngineConfig) -> DtypeChoice:
    """Step 1b: the dtype the model runs in and why (``framework.platform.choose_dtype``): ``dtype="auto"``
    takes the checkpoint's (``config.json``'s ``dtype``, float32 when it names none), as vLLM's
    ``dtype="auto"``, except that a bf16/fp16 checkpoint runs in float32 on a CPU without native
    instructions for it (AVX2-only, e.g. AMD Zen 3); an explicit dtype is kept (``emulated`` when the CPU
    lacks its instructions). A simulated analytic device (``executor=sim`` with ``profile=analytic:<gpu>``) is a
    GPU: it keeps the checkpoint's dtype whatever this CPU has. Transformers parity is checked in float32: ask
    for it with ``dtype="float32"``.

    Raises:
        FileNotFoundError, ModuleNotFoundError: ``dtype="auto"`` and the model cannot be found
            (see ``resolve_model_path``).
    """
    checkpoint = config.dtype
    if config.dtype == "auto":

        checkpoint = checkpoint_dtype(load_model_config(config.model))
    profile = str(config.executor_params.get("profile", "")) if config.executor == "sim" else ""
    device = "cuda" if profile.startswith("analytic:") else config.device  # a simulated GPU, not this CPU
    return choose_dtype(config.dtype, checkpoint, device)


def resolve_dtype(config: EngineConfig) -> EngineConfig:
    """``config`` with its dtype resolved by :func:`dtype_choice` (``config`` itself when explicit: nothing
    is read from disk then).

    Raises:
        FileNotFoundError, ModuleNotFoundError: the model cannot be found (see ``resolve_model_path``).
    """
    if config.dtype != "auto":
        return config
    return dataclasses.replace(config, dtype=dtype_choice(config).dtype)


def validate_plugins(config: EngineConfig) -> list[type | None]:
    """Step 1: resolve every plugin name, then (with ``dtype="auto"`` resolved from ``config.json``)
    run each class's capability check, before any weights load.

    Returns:
        The class chosen for each kind of ``PLUGIN_FIELDS`` (``None`` for ``none``).

    Raises:
        registry.UnknownPluginError: an unknown name (lists the valid choices).
        ValueError: a plugin that cannot run here or with this config, or a combination ``lora.enable=true`` does not
            support yet (``framework/engine/lora_support.py``); each problem names a fix.
    """
    classes = [registry.get_class(kind, getattr(config, kind)) for kind in PLUGIN_FIELDS]  # names first
    config = resolve_dtype(config)
    problems: list[str] = kv_transfer_problems(config) + lora_problems(config) + tree_problems(config)
    for cls in classes:
        if cls is not None:
            problems += cls.validate(config)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        problems.append(f"device={config.device!r} but CUDA is not available; use device=cpu")
    if problems:
        raise ValueError("cannot build the engine:\n  - " + "\n  - ".join(problems))
    return classes


def inspect_model(config: EngineConfig) -> ModelSpec:
    """Step 2: read ``config.json``, resolve ``max_model_len``, describe each layer's attention
    (``framework.model_executor.model_families.attention_layers``) and let the backend refuse the model.

    Raises:
        ValueError: a pre-quantized checkpoint, ``max_model_len`` above the model's
            ``max_position_embeddings``, an architecture servelab cannot run exactly
            (``UnsupportedModelError``: encoder-decoder, non-causal, attention outside transformers'
            interface, unknown layer types), a model the attention backend cannot run (the error
            names the backends that can), or a ``tensor_parallel_size`` the model cannot be sharded over
            (:func:`tensor_parallel_problems`).
    """

    mc = load_model_config(config.model)
    refuse_prequantized(mc, config.quant)
    max_pos = int(getattr(mc, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or max_pos
    if max_pos and max_model_len > max_pos:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}")
    layers = attention_layers(mc, config.mla_latent_cache)
    if family_of(mc.model_type) is None:
        logger.warning("model_type %r is not among the families servelab tests (servelab models); its attention "
                       "calls are checked against config.json, the rest of the model is transformers' own",
                       mc.model_type)
    spec = ModelSpec(hf_config=mc, max_model_len=max_model_len, num_layers=mc.num_hidden_layers,
                     num_heads=layers[0].num_heads, num_kv_heads=layers[0].num_kv_heads,
                     head_size=max(layer.cache_head_size for layer in layers), vocab_size=mc.vocab_size,
                     attention_layers=layers)
    if config.enable_expert_parallel and config.executor != "sim":  # sim prices EP itself (framework/sim)
        if ep_refusals := ep_problems(mc, config.tensor_parallel_size, ExpertParallelConfig.of(config)):
            raise ValueError("cannot build the engine:\n  - " + "\n  - ".join(ep_refusals))
    problems = registry.get_class("attention", config.attention).validate_model(layers, config)
    if config.tensor_parallel_size > 1 and not problems:
        problems = tensor_parallel_problems(config, mc, spec)
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

def tensor_parallel_problems(config: EngineConfig, model_config: Any, spec: ModelSpec) -> list[str]:
    """Why the model cannot run over ``tensor_parallel_size`` ranks (empty: it can), from its config
    alone: no tp plan or heads the size does not split (names the valid sizes), the attention
    backend refusing a rank's heads, the quant method refusing the shards
    (``QuantMethod.validate_tp``)."""
    tp = config.tensor_parallel_size
    problems = tp_problems(model_config, tp)
    if problems:
        return problems
    layout = rank_layout(model_config, 0, tp)  # every rank holds as many heads as rank 0
    rank_layers = shard_layer_specs(spec.attention_layers, layout)
    problems = [f"tensor_parallel_size={tp} (each rank: {layout.num_heads} query / {rank_layers[0].num_kv_heads} KV heads): "
                f"{p}" for p in registry.get_class("attention", config.attention).validate_model(rank_layers, config)]
    quant = registry.get_class("quant", config.quant)
    if quant is not None:
        problems += quant.validate_tp(config, tp)
    return problems


def make_executor(config: EngineConfig) -> Executor:
    """Step 3: the executor; constructing it starts every worker rank, which loads its model.

    Raises:
        WorkerError: a rank failed to start (bad weights, out of memory): its error and traceback.
    """
    return registry.create("executor", config.executor, config=config, **config.plugin_params("executor"))



def plan_kv_cache(config: EngineConfig, spec: ModelSpec) -> KVCacheLayout:
    """Step 3: the KV cache groups (``framework/core/kv_cache_groups.py``; every worker rank computes the
    same layout from the same config). With an allocator that declares ``supports_kv_cache_groups``
    (``paged``), each sliding window gets groups of its own whose out-of-window blocks are released;
    otherwise one group of every layer, logged when the model has sliding-window layers (correct, but no
    saving)."""
    windows = sorted({w for layer in spec.attention_layers if (w := layer.sliding_window)})
    release = registry.get_class("kv_allocator", config.kv_allocator).supports_kv_cache_groups
    layout = plan_kv_cache_layout(config.kv_allocator, spec.attention_layers)
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


def size_kv_cache(config: EngineConfig, executor: Executor, spec: ModelSpec,
                  layout: KVCacheLayout) -> tuple[int, int]:
    """Step 5: ``(num_blocks, num_swap_blocks)``: ``num_blocks`` if set, else the KV budget that fits
    every rank (``executor.determine_available_memory``) over one block's bytes on a rank
    (``layout.layers_per_block`` layers; the null block of a layout with sliding groups comes out of
    the budget); swap blocks for ``preemption_mode=swap`` likewise from ``swap_space_bytes`` (0 otherwise).

    Raises:
        ValueError: the cache cannot hold one ``max_model_len`` request (names the knobs to raise).
    """
    bytes_per_block = executor.kv_cache_bytes_per_block()
    num_blocks = (config.num_blocks
                  or executor.determine_available_memory() // bytes_per_block - layout.has_null_block)
    chunk = min(config.max_num_batched_tokens, config.long_prefill_token_threshold or config.max_num_batched_tokens)
    needed = layout.max_blocks_per_request(spec.max_model_len, config.block_size, chunk)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache holds {num_blocks} blocks x {config.block_size} tokens, fewer than one "
            f"max_model_len={spec.max_model_len} request needs ({needed} blocks); raise kv_cache_memory_bytes/"
            "num_blocks or lower max_model_len")
    num_swap_blocks = config.swap_space_bytes // bytes_per_block if config.preemption_mode == "swap" else 0
    return num_blocks, num_swap_blocks


def make_scheduler(config: EngineConfig, spec: ModelSpec, num_blocks: int, num_swap_blocks: int,
                   tokenizer: Any, layout: KVCacheLayout, clock: Clock | None = None) -> Scheduler:
    """Step 6: KV allocator (given the KV cache groups when it supports them) + scheduler policy +
    (swap preemption) swap space + stop checker, all on the driver; ``clock``: the executor's
    (``Executor.clock``), the time source of the requests' timestamps and of the policy."""
    params = config.plugin_params("kv_allocator")
    if registry.get_class("kv_allocator", config.kv_allocator).supports_kv_cache_groups:
        params["kv_cache_groups"] = layout.groups
    allocator = registry.create("kv_allocator", config.kv_allocator, num_blocks=num_blocks,
                                block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                max_model_len=spec.max_model_len, **params)
    policy = registry.create("scheduler", config.scheduler, **config.plugin_params("scheduler"))
    swap_space = SwapSpace(num_swap_blocks) if config.preemption_mode == "swap" else None
    return Scheduler(policy, allocator, StopChecker(tokenizer), max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=spec.max_model_len,
                     long_prefill_token_threshold=config.long_prefill_token_threshold, swap_space=swap_space,
                     clock=clock, max_loras=config.max_loras if config.enable_lora else 0,
                     kv_transfer=make_kv_transfer(config, spec.num_layers))


def attach_structured_output(config: EngineConfig, tokenizer: Any, eos_token_ids: frozenset[int],
                             spec: ModelSpec) -> StructuredOutputManager | None:
    """Step 7a: the grammar engine (``grammar != none``) on the driver: it fills each step's bitmask."""
    if config.grammar == "none":
        return None
    grammar = registry.create("grammar", config.grammar, tokenizer=tokenizer, vocab_size=spec.vocab_size,
                              eos_token_ids=eos_token_ids, **config.plugin_params("grammar"))
    return StructuredOutputManager(grammar, spec.vocab_size)


def attach_drafter(config: EngineConfig, executor: Executor, spec: ModelSpec) -> Drafter | None:
    """Step 7b: the drafter (``spec_decode != none``), on the driver, loaded after the target.

    It gets the target model when it lives in this process (``uniproc``), else only the target's
    embedding and LM head loaded here (what EAGLE shares); an EAGLE-style drafter makes the driver
    rank return the target's hidden states with each output. An executor that simulates the model
    replaces it with its stand-in (``Executor.simulated_drafter``), which loads nothing.
    """
    drafter = registry.create("drafter", config.drafter, **config.plugin_params("drafter"))
    if drafter is not None and (simulated := executor.simulated_drafter(drafter)) is not None:
        return simulated  # a simulated model: the executor's stand-in drafts (no weights, no hidden states)
    if drafter is not None:
        target = executor.driver_model()
        if target is None:
            target = load_embeddings(config.model, config.dtype, config.device)
        drafter.load(model=target, model_config=spec.hf_config, config=config)
        if drafter.needs_hidden_states:
            executor.collective_rpc("set_keep_hidden_states", args=(True,))
        apply_acceptance(config, executor)
    return drafter



def assemble(config: EngineConfig, scheduler: Scheduler, executor: Executor, tokenizer: Any,
             eos_token_ids: frozenset[int], spec: ModelSpec, layout: KVCacheLayout,
             structured: StructuredOutputManager | None, drafter: Drafter | None,
             metrics: MetricsCollector | None) -> LLMEngine:
    """Step 8: the engine; records the KV cache's shape in its metrics and fires ``on_engine_start``."""
    engine = LLMEngine(config, scheduler, executor, tokenizer, eos_token_ids, spec.vocab_size, metrics,
                       structured, drafter)
    bytes_per_block = executor.kv_cache_bytes_per_block()
    num_blocks = scheduler.kv.num_blocks
    engine.metrics.kv_cache_info = {
        "kv_cache_dtype": config.kv_cache_dtype, "kv_cache_num_blocks": num_blocks,
        "kv_cache_bytes_per_block": bytes_per_block, "kv_cache_num_groups": len(layout.groups),
        "kv_cache_layers_per_block": layout.layers_per_block,
        "kv_cache_group_windows": " ".join("full" if g.sliding_window is None else str(g.sliding_window)
                                           for g in layout.groups)}
    engine.metrics.compile_stats = RankZeroCompileStats(executor)
    if config.enable_expert_parallel and config.executor != "sim":
        engine.metrics.expert_load = RankZeroExpertLoad(executor)
    logger.info("engine ready: executor=%s x %d ranks, %d KV blocks per rank (%.1f MiB, kv_cache_dtype=%s, "
                "%d bytes/block), max_model_len=%d", config.executor, config.tensor_parallel_size, num_blocks,
                (num_blocks + layout.has_null_block) * bytes_per_block / 2**20, config.kv_cache_dtype,
                bytes_per_block, spec.max_model_len)
    registry.call_hook("on_engine_start", config=config.to_dict())
    return engine
