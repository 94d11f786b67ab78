"""``build_engine``: from an :class:`~framework.config.EngineConfig` to a running :class:`LLMEngine`.

The steps, in the order they run (each a function below, so a reader can follow one at a time):

1. :func:`validate_plugins` — every plugin name resolves and each class's ``validate(config)``
   passes (device, dtype, block size, executor and rank count...), before anything is read from disk.
2. :func:`inspect_model` — ``config.json`` only: refuse pre-quantized checkpoints, resolve
   ``max_model_len``, read the attention shape (:class:`ModelSpec`), let the attention backend
   refuse a model it cannot run and refuse a tensor-parallel size the model cannot be split over
   (its plan, its heads, a rank's heads for the backend, the quant method's shards) — still
   before any weights load.
3. :func:`make_executor` — the executor starts its worker ranks; each loads its model (its shard),
   applies the quant method, prepacks CPU linears and builds its attention backend
   (``framework.worker.worker``). The driver loads only the tokenizer.
4. :func:`size_kv_cache` — how many KV blocks fit every rank (at least one ``max_model_len``
   request), then ``executor.initialize_cache`` allocates them and builds each rank's runner.
5. :func:`make_scheduler` — KV allocator, scheduler policy, swap space, stop checker (driver).
6. :func:`attach_structured_output`, :func:`attach_drafter` — grammar engine and drafter, if
   chosen, both on the driver.
7. :func:`assemble` — the engine, its metrics' KV info, the ``on_engine_start`` hook.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from framework import registry
from framework.config import PLUGIN_FIELDS, EngineConfig
from framework.core.scheduler import Scheduler
from framework.core.stop import StopChecker
from framework.core.structured_output import StructuredOutputManager
from framework.core.swap import SwapSpace
from framework.engine.llm_engine import LLMEngine
from framework.interfaces import Drafter, Executor
from framework.metrics.collector import MetricsCollector
from framework.worker.embeddings import load_embeddings
from framework.worker.model_loader import load_tokenizer
from framework.worker.tensor_parallel import rank_layout, tp_problems

logger = logging.getLogger(__name__)

@dataclass
class ModelSpec:
    """What the engine must know about a model before its weights load (read from ``config.json``)."""

    hf_config: Any  # transformers PretrainedConfig
    max_model_len: int  # prompt + output cap, tokens
    num_layers: int  # decoder layers (one KV cache tensor each)
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key/value heads per layer
    head_size: int  # channels per head
    vocab_size: int  # logits columns


def build_engine(config: EngineConfig, metrics: MetricsCollector | None = None) -> LLMEngine:
    """Validate plugins, inspect the model, start the workers, size the KV cache and assemble the engine.

    Args:
        metrics: collector of step/request metrics (e.g. with goodput SLOs); default a plain one.

    Raises:
        registry.UnknownPluginError, ValueError: from :func:`validate_plugins` or
            :func:`inspect_model` (before any weights load), or a KV budget smaller than one
            ``max_model_len`` request (:func:`size_kv_cache`).
        WorkerError: a worker rank failed to start (its traceback in the message).
    """
    validate_plugins(config)
    spec = inspect_model(config)
    tokenizer, eos_token_ids = load_tokenizer(config.model, config.tokenizer)
    executor = make_executor(config)
    try:
        num_blocks, num_swap_blocks = size_kv_cache(config, executor, spec)
        executor.initialize_cache(num_blocks, num_swap_blocks)
        scheduler = make_scheduler(config, spec, num_blocks, num_swap_blocks, tokenizer)
        structured = attach_structured_output(config, tokenizer, eos_token_ids, spec)
        drafter = attach_drafter(config, executor, spec)
        return assemble(config, scheduler, executor, tokenizer, eos_token_ids, spec, structured, drafter, metrics)
    except BaseException:
        executor.shutdown()
        raise


def validate_plugins(config: EngineConfig) -> list[type | None]:
    """Step 1: resolve every plugin choice and run its capability check, before any weights load.

    Returns:
        The class chosen for each kind of ``PLUGIN_FIELDS`` (``None`` for ``none``).

    Raises:
        registry.UnknownPluginError: an unknown name (lists the valid choices).
        ValueError: a plugin that cannot run here or with this config (each problem names a fix).
    """
    classes, problems = [], []
    for kind in PLUGIN_FIELDS:
        name = getattr(config, kind)
        cls = registry.get_class(kind, name)
        classes.append(cls)
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
    """Step 2: read ``config.json``, resolve ``max_model_len`` and let the backend refuse the model.

    Raises:
        ValueError: a pre-quantized checkpoint, ``max_model_len`` above the model's
            ``max_position_embeddings``, a model shape the attention backend cannot run, or a
            ``tensor_parallel_size`` the model cannot be sharded over
            (:func:`tensor_parallel_problems`).
    """
    from framework.worker.model_loader import load_model_config

    mc = load_model_config(config.model)
    refuse_prequantized(mc)
    max_pos = int(getattr(mc, "max_position_embeddings", 0) or 0)
    max_model_len = config.max_model_len or max_pos
    if max_pos and max_model_len > max_pos:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}")
    head_size = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    spec = ModelSpec(hf_config=mc, max_model_len=max_model_len, num_layers=mc.num_hidden_layers,
                     num_heads=mc.num_attention_heads, num_kv_heads=mc.num_key_value_heads, head_size=head_size,
                     vocab_size=mc.vocab_size)
    problems = registry.get_class("attention", config.attention).validate_model(
        spec.num_heads, spec.num_kv_heads, spec.head_size)
    if config.tensor_parallel_size > 1 and not problems:
        problems = tensor_parallel_problems(config, mc, spec)
    if problems:
        raise ValueError("cannot build the engine:\n  - " + "\n  - ".join(problems))
    return spec


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
    problems = [f"tensor_parallel_size={tp} (each rank: {layout.num_heads} query / {layout.num_kv_heads} KV heads): "
                f"{p}" for p in registry.get_class("attention", config.attention).validate_model(
                    layout.num_heads, layout.num_kv_heads, spec.head_size)]
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


def size_kv_cache(config: EngineConfig, executor: Executor, spec: ModelSpec) -> tuple[int, int]:
    """Step 4: ``(num_blocks, num_swap_blocks)``: ``num_blocks`` if set, else the KV budget that fits
    every rank (``executor.determine_available_memory``) over one block's bytes on a rank; swap
    blocks for ``preemption_mode=swap`` likewise from ``swap_space_bytes`` (0 otherwise).

    Raises:
        ValueError: the cache cannot hold one ``max_model_len`` request (names the knobs to raise).
    """
    bytes_per_block = executor.kv_cache_bytes_per_block()
    num_blocks = config.num_blocks or executor.determine_available_memory() // bytes_per_block
    if num_blocks * config.block_size < spec.max_model_len:
        raise ValueError(
            f"KV cache holds {num_blocks} blocks x {config.block_size} tokens = {num_blocks * config.block_size} "
            f"tokens, fewer than one max_model_len={spec.max_model_len} request; raise kv_cache_memory_bytes/"
            "num_blocks or lower max_model_len")
    num_swap_blocks = config.swap_space_bytes // bytes_per_block if config.preemption_mode == "swap" else 0
    return num_blocks, num_swap_blocks


def make_scheduler(config: EngineConfig, spec: ModelSpec, num_blocks: int, num_swap_blocks: int,
                   tokenizer: Any) -> Scheduler:
    """Step 5: KV allocator + scheduler policy + (swap preemption) swap space + stop checker."""
    allocator = registry.create("kv_allocator", config.kv_allocator, num_blocks=num_blocks,
                                block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                max_model_len=spec.max_model_len, **config.plugin_params("kv_allocator"))
    policy = registry.create("scheduler", config.scheduler, **config.plugin_params("scheduler"))
    swap_space = SwapSpace(num_swap_blocks) if config.preemption_mode == "swap" else None
    return Scheduler(policy, allocator, StopChecker(tokenizer), max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=spec.max_model_len,
                     long_prefill_token_threshold=config.long_prefill_token_threshold, swap_space=swap_space)


def attach_structured_output(config: EngineConfig, tokenizer: Any, eos_token_ids: frozenset[int],
                             spec: ModelSpec) -> StructuredOutputManager | None:
    """Step 6a: the grammar engine (``grammar != none``) on the driver: it fills each step's bitmask."""
    if config.grammar == "none":
        return None
    grammar = registry.create("grammar", config.grammar, tokenizer=tokenizer, vocab_size=spec.vocab_size,
                              eos_token_ids=eos_token_ids, **config.plugin_params("grammar"))
    return StructuredOutputManager(grammar, spec.vocab_size)


def attach_drafter(config: EngineConfig, executor: Executor, spec: ModelSpec) -> Drafter | None:
    """Step 6b: the drafter (``spec_decode != none``), on the driver, loaded after the target.

    It gets the target model when it lives in this process (``uniproc``), else only the target's
    embedding and LM head loaded here (what EAGLE shares); an EAGLE-style drafter makes the driver
    rank return the target's hidden states with each output.
    """
    drafter = registry.create("drafter", config.drafter, **config.plugin_params("drafter"))
    if drafter is not None:
        target = executor.driver_model()
        if target is None:
            target = load_embeddings(config.model, config.dtype, config.device)
        drafter.load(model=target, model_config=spec.hf_config, config=config)
        if drafter.needs_hidden_states:
            executor.collective_rpc("set_keep_hidden_states", args=(True,))
    return drafter


def assemble(config: EngineConfig, scheduler: Scheduler, executor: Executor, tokenizer: Any,
             eos_token_ids: frozenset[int], spec: ModelSpec, structured: StructuredOutputManager | None,
             drafter: Drafter | None, metrics: MetricsCollector | None) -> LLMEngine:
    """Step 7: the engine; records the KV cache's shape in its metrics and fires ``on_engine_start``."""
    engine = LLMEngine(config, scheduler, executor, tokenizer, eos_token_ids, spec.vocab_size, metrics,
                       structured, drafter)
    bytes_per_block = executor.kv_cache_bytes_per_block()
    num_blocks = scheduler.kv.num_blocks
    engine.metrics.kv_cache_info = {"kv_cache_dtype": config.kv_cache_dtype, "kv_cache_num_blocks": num_blocks,
                                    "kv_cache_bytes_per_block": bytes_per_block}
    engine.metrics.compile_stats = RankZeroCompileStats(executor)
    logger.info("engine ready: executor=%s x %d ranks, %d KV blocks per rank (%.1f MiB, kv_cache_dtype=%s, "
                "%d bytes/block), max_model_len=%d", config.executor, config.tensor_parallel_size, num_blocks,
                num_blocks * bytes_per_block / 2**20, config.kv_cache_dtype, bytes_per_block, spec.max_model_len)
    registry.plugin_manager().hook.on_engine_start(config=config.to_dict())
    return engine


class RankZeroCompileStats:
    """Rank 0's :class:`~framework.worker.compile.CompileStats`, fetched afresh whenever the metrics
    read it (recompiles grow inside the worker; a worker process would otherwise leave the driver a
    stale copy). After the executor died, the last copy fetched."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._last = executor.collective_rpc("compile_stats", unique_reply_rank=0)[0]
        self.enabled = self._last.enabled  # engine.compile was requested

    def as_dict(self) -> dict[str, Any]:
        """``CompileStats.as_dict`` of rank 0 now (``metrics.json`` keys)."""
        if self._executor.dead is None:
            try:
                self._last = self._executor.collective_rpc("compile_stats", unique_reply_rank=0)[0]
            except RuntimeError:  # shut down or lost meanwhile: keep the last copy
                pass
        return self._last.as_dict()

