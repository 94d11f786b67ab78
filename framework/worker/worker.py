"""One rank of an executor (vLLM V1's ``Worker``): its device, its shard of the model, its KV cache
and its model runner.

The executor creates one ``Worker`` per rank (in-process for ``uniproc``, in a spawned process for
``mp``, in a Ray actor for ``ray``) and calls its methods by name (``collective_rpc``), in this
order: :meth:`Worker.init_device`, :meth:`Worker.load_model`, :meth:`Worker.determine_available_memory`
and :meth:`Worker.kv_cache_bytes_per_block` (the driver takes the minimum over ranks),
:meth:`Worker.initialize_cache`, then :meth:`Worker.execute_model` once per step. Everything here
is per rank: weights (this rank's shard under tensor parallelism), quant method, prepacked linears,
attention backend (this rank's heads), KV and swap tensors, ``torch.compile`` graphs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from framework import registry
from framework.compilation.cuda_graphs import cuda_graph_options
from framework.compilation.decoder import CompileStats
from framework.config import EngineConfig
from framework.core.kv_cache_groups import KVCacheLayout, plan_kv_cache_layout
from framework.core.outputs import ModelRunnerOutput
from framework.core.step_message import StepMessage
from framework.distributed.parallel_state import (
    DISTRIBUTED_TIMEOUT_S,
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_pp_group,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from framework.interfaces import AttentionBackend, AttentionLayerSpec
from framework.model_executor import parallel_layers
from framework.model_executor.cpu_malloc import tune_malloc
from framework.model_executor.expert_parallel import ExpertParallelConfig, load_ep_model
from framework.model_executor.forward_context import register_attention_implementation
from framework.model_executor.lora_layers import LoRAModelManager
from framework.model_executor.lora_tp import lora_shards
from framework.model_executor.mla import use_latent_attention
from framework.model_executor.model_families import attention_layers
from framework.model_executor.model_loader import LoadedModel, load_model
from framework.model_executor.pipeline_parallel import split_stage, stage_kv_slots
from framework.model_executor.prepack import prepack_linears, should_prepack
from framework.model_executor.tensor_parallel import rank_layout, shard_layer_specs
from framework.model_executor.tp_weights import load_sharded_model, load_tp_model
from framework.sample.sampler import Sampler
from framework.worker.kv_connector_runner import make_kv_connector_runner
from framework.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8,
                                                   "fp8_e4m3": torch.float8_e4m3fn}


def distributed_timeout_s(config: EngineConfig) -> float:
    """:data:`~framework.distributed.parallel_state.DISTRIBUTED_TIMEOUT_S`, or the executor's
    ``compile_timeout_s`` when that is longer: the timeout must outlast a compile warm-up, during which
    one rank may wait in a collective for another that still compiles (~130 s per graph cold at TP=2)."""
    return max(float(DISTRIBUTED_TIMEOUT_S), float(config.executor_params.get("compile_timeout_s") or 0))


def default_num_threads(tensor_parallel_size: int) -> int:
    """Threads per rank: the cores this process may use, split evenly over the ranks (at least 1), and at most
    ``$OMP_NUM_THREADS`` where the user set it (as torch itself honours it in a plain process: two threads
    spinning on a core that another program holds make every parallel region wait, 10-20x slower steps)."""
    threads = max(1, len(os.sched_getaffinity(0)) // tensor_parallel_size)
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(omp)) if omp.isdigit() and int(omp) >= 1 else threads


@dataclass
class LoadedWeights(LoadedModel):
    """A :class:`LoadedModel` after the quant method and prepacking ran."""

    kv_cache_dtype: torch.dtype | None = None  # what the quant method asks of the KV cache (None: model dtype)
    stage_layers: tuple[int, int] | None = None  # pipeline_parallel_size > 1: [start, end) of this stage's layers


def load_weights(config: EngineConfig, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0) -> LoadedWeights:
    """Load this rank's model (its shard when ``tp_size > 1``: :func:`load_tp_model`, which needs
    ``torch.distributed`` initialised) and tokenizer with attention routed to servelab, keep only stage
    ``pp_rank``'s modules when ``pipeline_parallel_size > 1`` (:func:`split_stage`: the others' weights are
    released before the quant method and prepacking see the model), apply the quant method (to the shard),
    prepack CPU linears (the shard's)."""
    device = torch.device(config.device)
    if config.tune_malloc and device.type == "cpu":
        tune_malloc()
    if tp_size > 1 and config.pipeline_parallel_size > 1:  # the world is TP x PP: shard over the stage's TP group
        loaded = load_sharded_model(config.model, getattr(torch, config.dtype), device, tp_rank, tp_size,
                                    register_attention_implementation(), get_tp_group().group_name)
    elif tp_size > 1 and config.enable_expert_parallel:  # whole experts per rank, attention tensor-parallel
        loaded = load_ep_model(config.model, config.dtype, config.device, tp_rank, tp_size,
                               register_attention_implementation(), ExpertParallelConfig.of(config))
    elif tp_size > 1:
        loaded = load_tp_model(config.model, config.dtype, config.device, tp_rank, tp_size,
                               register_attention_implementation())
    else:
        loaded = load_model(config.model, dtype=config.dtype, device=config.device,
                            attn_implementation=register_attention_implementation())
    model, dtype = loaded.model, getattr(torch, config.dtype)
    stage = None
    if config.pipeline_parallel_size > 1:
        stage = split_stage(model, pp_rank, config.pipeline_parallel_size, config.pp_layer_partition)
    quant = registry.create("quant", config.quant, **config.plugin_params("quant"))
    if quant is not None:
        model = quant.apply(model)
    if should_prepack(config.prepack_linears, device, dtype, config.compile_freezing):
        # auto: gate/up unfused if compiled later; LoRA wraps fused GEMMs part by part, unfused under TP (sharded parts)
        num_gemms = prepack_linears(model, compiled=config.compile == "true",
                                    fuse=not (config.enable_lora and tp_size > 1))
        logger.info("prepack_linears: %d GEMMs prepacked for oneDNN", num_gemms)
    return LoadedWeights(model=model, tokenizer=loaded.tokenizer, config=loaded.config,
                         eos_token_ids=loaded.eos_token_ids, max_model_len=loaded.max_model_len, path=loaded.path,
                         kv_cache_dtype=quant.kv_cache_dtype(dtype) if quant is not None else None,
                         stage_layers=stage)


def make_lora_manager(config: EngineConfig, model: torch.nn.Module, tp_rank: int = 0,
                      tp_size: int = 1) -> LoRAModelManager:
    """Wrap ``model``'s targetable linears with ``max_loras`` LoRA slots and build the ``lora_backend`` plugin
    (``lora.enable=true``; unfused linears: the builder refuses the rest). Under tensor parallelism (``tp_size > 1``)
    each slot holds this rank's cut of A and B (``framework/model_executor/lora_tp.py``)."""
    backend = registry.create("lora_backend", config.lora_backend, **config.plugin_params("lora_backend"))
    shards, full_shapes = lora_shards(model.config, tp_rank, tp_size) if tp_size > 1 else (None, None)
    return LoRAModelManager(model, backend, config.max_loras, config.max_lora_rank,
                            config.max_cpu_loras or config.max_loras, shards, full_shapes)


def make_attention_backend(config: EngineConfig, model: torch.nn.Module, layers: list[AttentionLayerSpec],
                           quant_kv_dtype: torch.dtype | None) -> AttentionBackend:
    """The backend for this rank's layers (``layers``: per layer, this rank's heads); its default
    softmax scale is the first attention module's ``scaling`` (``head_size ** -0.5`` when it has none;
    a layer that differs passes its own with each call); the cache dtype is ``engine.kv_cache_dtype``,
    else what the quant method asks, else the model dtype."""
    kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or quant_kv_dtype or getattr(torch, config.dtype)
    scale = next((float(m.scaling) for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "layer_idx")),
                 layers[0].head_size ** -0.5)
    return registry.create("attention", config.attention, num_heads=layers[0].num_heads,
                           num_kv_heads=layers[0].num_kv_heads,
                           head_size=max(layer.cache_head_size for layer in layers), scale=scale,
                           block_size=config.block_size, dtype=kv_dtype, device=torch.device(config.device),
                           layers=layers, **config.plugin_params("attention"))


class Worker:
    """One rank: device set-up, model shard, attention backend, KV cache and model runner.

    Args:
        config: the engine config (a plain copy in worker processes).
        rank: the rank in the engine's world, ``0 <= rank < world_size``: tensor-parallel rank
            ``rank % tensor_parallel_size`` of pipeline stage ``rank // tensor_parallel_size``; the first rank
            of the last stage is the driver rank (it alone samples and returns outputs; rank 0 without PP).
        world_size: ``parallel.tensor_parallel_size * parallel.pipeline_parallel_size``.
        distributed_init_method: ``tcp://host:port`` of rank 0's rendezvous (``world_size > 1``).
        own_process: the rank has a process of its own (``mp``, ``ray``): it then sets its torch
            threads to cores / ranks by default; an in-process rank (``uniproc``) leaves the
            caller's thread setting alone unless ``num_threads_per_rank`` is set.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None, own_process: bool = False) -> None:
        self.config = config
        self.own_process = own_process
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.loaded: LoadedWeights | None = None
        self.backend: AttentionBackend | None = None
        self.runner: ModelRunner | None = None
        self.lora: LoRAModelManager | None = None  # lora.enable=true: this rank's adapter slots (load_model)
        self.kv_cache_layout: KVCacheLayout | None = None
        self.keep_hidden_states = False
        self.tp_group: GroupCoordinator | None = None  # world_size > 1: this rank's TP group (init_device)
        self.pp_group: GroupCoordinator | None = None  # pipeline_parallel_size > 1: its stage-to-stage group
        self.tp_size = config.tensor_parallel_size
        self.pp_size = config.pipeline_parallel_size
        self.pp_rank, self.tp_rank = divmod(rank, self.tp_size)  # its stage, its rank within the stage
        self.stage_layers: tuple[int, int] | None = None  # pipeline_parallel_size > 1: [start, end) it runs

    @property
    def is_driver_rank(self) -> bool:
        """True on the rank that samples and replies: TP rank 0 of the last pipeline stage (rank 0 without PP)."""
        return self.rank == (self.pp_size - 1) * self.tp_size

    @property
    def num_local_ranks(self) -> int:
        """Ranks of the engine on this host (they share its RAM); 1 for a one-rank engine."""
        if self.tp_group is None:
            return 1
        return self.tp_group.num_local_ranks * (self.pp_group.num_local_ranks if self.pp_group is not None else 1)

    @property
    def communicator(self) -> Any:
        """The group's shared-memory communicator when ``parallel.communicator`` chose it, else ``None``."""
        return self.tp_group.communicator if self.tp_group is not None else None

    def init_device(self) -> None:
        """Threads (``parallel.num_threads_per_rank``; default cores / ranks in a process of its own)
        and, for more than one rank, the TP group (``framework.distributed.parallel_state``:
        torch.distributed with gloo on CPU, NCCL on CUDA, and the ``parallel.communicator``)."""
        threads = self.config.num_threads_per_rank or (default_num_threads(self.world_size) if self.own_process else 0)
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        device = torch.device(self.config.device)
        if device.type == "cuda":  # rank r on cuda:r; a Ray actor sees only its own GPU (index 0)
            torch.cuda.set_device(device.index if device.index is not None else self.rank % torch.cuda.device_count())
        if self.world_size > 1:
            timeout_s = distributed_timeout_s(self.config)
            init_distributed_environment(self.world_size, self.rank, self.distributed_init_method,
                                         backend="nccl" if device.type == "cuda" else "gloo", timeout_s=timeout_s)
            self.tp_group = initialize_model_parallel(self.tp_size, device.type, self.config.communicator,
                                                      timeout_s=timeout_s, pipeline_model_parallel_size=self.pp_size)
            self.pp_group = get_pp_group() if self.pp_size > 1 else None

    def load_model(self) -> None:
        """Load this rank's weights (quantized, prepacked), build its attention backend for its
        heads and plan its KV cache layout (the driver's: ``plan_kv_cache_layout``)."""

        self.loaded = load_weights(self.config, self.tp_rank, self.tp_size, self.pp_rank)
        mc = self.loaded.config
        self.stage_layers = self.loaded.stage_layers
        layers = attention_layers(mc, self.config.mla_latent_cache)
        use_latent_attention(self.loaded.model, layers)  # MLA: the bridge absorbs around latent calls
        if self.tp_size > 1:  # this rank's share of the heads (KV heads replicated when tp > their count)
            layers = shard_layer_specs(layers, rank_layout(mc, self.tp_rank, self.tp_size))
        self.backend = make_attention_backend(self.config, self.loaded.model, layers, self.loaded.kv_cache_dtype)
        self.lora = (make_lora_manager(self.config, self.loaded.model, self.tp_rank, self.tp_size)
                     if self.config.enable_lora else None)
        self.kv_cache_layout = plan_kv_cache_layout(self.config.kv_allocator, layers)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block on this rank, K and V of the ``layers_per_block`` layers that share a
        block id (all layers without sliding-window groups); under pipeline parallelism only the KV tensors
        of this stage's layers (:func:`stage_kv_slots`), so a stage of fewer layers fits more blocks."""
        return self.backend.kv_cache_bytes_per_block(len(self.kv_slots))

    @property
    def kv_slots(self) -> list[int]:
        """The KV tensors (slots of the layout) this rank allocates: all, or its stage's layers' ones."""
        layout = self.kv_cache_layout
        if self.stage_layers is None:
            return list(range(layout.layers_per_block))
        return stage_kv_slots(layout, *self.stage_layers)

    def determine_available_memory(self) -> int:
        """Bytes this rank may give its KV cache: ``kv_cache_memory_bytes``, capped at 90% of the
        device's free memory (CUDA: ``mem_get_info``; CPU: available RAM divided by the group's
        ranks on this host, which share it). The executor takes the minimum over ranks."""
        budget = self.config.kv_cache_memory_bytes
        if torch.device(self.config.device).type == "cuda":
            free = torch.cuda.mem_get_info()[0]
        else:
            import psutil

            free = psutil.virtual_memory().available // self.num_local_ranks
        if budget > 0.9 * free:
            logger.warning("rank %d: kv_cache_memory_bytes=%d exceeds 90%% of its free memory (%d bytes); capped",
                           self.rank, budget, free)
        return int(min(budget, 0.9 * free))

    def initialize_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        """Allocate this rank's KV (and swap) tensors and its model runner (``compile``: warm-up here); a
        pipeline stage allocates its own layers' tensors only and runs eagerly (no decode CUDA graphs)."""
        spec = self.loaded.config
        self.runner = ModelRunner(self.loaded.model, self.backend, num_blocks, spec.num_hidden_layers,
                                  self.backend.cache_dtype, torch.device(self.config.device),
                                  Sampler(spec.vocab_size, seed=self.config.seed), num_swap_blocks=num_swap_blocks,
                                  compile=self.config.compile == "true",
                                  compile_freezing=self.config.compile_freezing,
                                  compile_backend=self.config.compile_backend,
                                  kv_cache_layout=self.kv_cache_layout, is_driver_rank=self.is_driver_rank,
                                  tensor_parallel=self.tp_size > 1, cuda_graphs=None if self.pp_size > 1 else
                                  cuda_graph_options(
                                      self.config.enforce_eager, self.backend, self.config.max_num_seqs,
                                      self.config.max_model_len or self.loaded.max_model_len, self.world_size,
                                      len(self.kv_cache_layout.groups)),
                                  pp_group=self.pp_group, kv_slots=self.kv_slots)
        self.runner.keep_hidden_states = self.keep_hidden_states
        self.runner.lora = self.lora
        self.runner.kv_connector = make_kv_connector_runner(self.config, self.runner.kv_caches, self.backend,
                                                            len(self.kv_cache_layout.groups), self.tp_rank,
                                                            self.pp_rank)

    def set_keep_hidden_states(self, keep: bool) -> None:
        """Return the target's last hidden states with each output (an EAGLE-style drafter asked)."""
        self.keep_hidden_states = keep
        if self.runner is not None:
            self.runner.keep_hidden_states = keep

    def execute_model(self, step: StepMessage) -> ModelRunnerOutput | None:
        """Run one step on this rank; the driver rank returns the sampled tokens, the others ``None``, or, with a
        KV connector, only their worker side's report (``kv_connector_output``: the executor merges every rank's,
        ``framework/executor/kv_output_aggregator.py``)."""
        out = self.runner.execute_model(step)
        if self.is_driver_rank:
            return out
        if self.runner.kv_connector is None:
            return None
        return ModelRunnerOutput(sampled_token_ids={}, kv_connector_output=out.kv_connector_output)

    def enable_collective_timing(self) -> None:
        """Time every collective this rank calls from now on (benchmarks:
        ``experiments/offline/bench_parallel.py``): the tensor-parallel layers' all-reduces and all-gathers
        (as ``framework.model_executor.parallel_layers`` calls them, wait included; shared-memory or torch.distributed),
        the LM head's gather to the driver, and any other ``torch.distributed`` call. Read with :meth:`collective_times`. Wall time of the call:
        exact for gloo (synchronous), a lower bound for NCCL (asynchronous). Eager forwards only:
        inside a compiled decoder the collectives are graph nodes and go uncounted."""
        import functools

        import torch.distributed as dist

        self._collective = {"collective_s": 0.0, "num_collectives": 0, "depth": 0}
        targets = [(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "gather",
                                             "reduce_scatter", "broadcast")]
        targets += [(parallel_layers, name) for name in ("all_reduce", "all_gather_last_dim", "gather_last_dim_to_driver")]
        for owner, name in targets:
            original = getattr(owner, name, None)
            if original is None or getattr(original, "_servelab_timed", False):
                continue

            @functools.wraps(original)
            def timed(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
                if self._collective["depth"]:  # inside a timed call (the LM head's gather wraps dist.gather)
                    return __original(*args, **kwargs)
                self._collective["depth"] = 1
                t0 = time.perf_counter()
                try:
                    return __original(*args, **kwargs)
                finally:
                    self._collective["collective_s"] += time.perf_counter() - t0
                    self._collective["num_collectives"] += 1
                    self._collective["depth"] = 0

            timed._servelab_timed = True  # type: ignore[attr-defined]
            setattr(owner, name, timed)

    def collective_times(self) -> dict[str, float]:
        """Seconds spent in, and number of, collectives since :meth:`enable_collective_timing`."""
        timing = getattr(self, "_collective", {"collective_s": 0.0, "num_collectives": 0})
        return {"collective_s": timing["collective_s"], "num_collectives": timing["num_collectives"]}

    def compile_decoder(self) -> None:
        """``torch.compile`` this rank's decoder now (``engine.compile=auto``; ``ModelRunner.compile_decoder``)."""
        self.runner.compile_decoder()

    def time_decode_steps(self, batch_sizes: list[int]) -> dict[int, float]:
        """Milliseconds of a dummy decode step per batch size on this rank (``ModelRunner.time_decode_steps``)."""
        return self.runner.time_decode_steps(batch_sizes)

    def rank_info(self) -> dict[str, int | str]:
        """What this rank holds and runs with (tests, logs): ``rank``, ``world_size``,
        ``num_local_ranks`` (ranks of the group on this host), ``num_threads`` (torch intra-op
        threads), ``num_heads`` / ``num_kv_heads`` (its attention backend's), ``parameter_bytes``
        (its model shard, a tied embedding counted once), ``communicator`` (``shm`` or
        ``torch_distributed``: what its tensor-parallel collectives go through)."""
        params = {id(p): p.numel() * p.element_size() for p in self.loaded.model.parameters()}
        return {"rank": self.rank, "world_size": self.world_size, "num_local_ranks": self.num_local_ranks,
                "num_threads": torch.get_num_threads(), "num_heads": self.backend.num_heads,
                "num_kv_heads": self.backend.num_kv_heads, "parameter_bytes": sum(params.values()),
                "communicator": "shm" if self.communicator is not None else "torch_distributed"}

    def compile_stats(self) -> CompileStats:
        """This rank's compile statistics (``enabled=False`` when eager)."""
        return self.runner.compile_stats

    def check_health(self) -> None:
        """Nothing to check in-process: a rank that answers is alive."""

    def shutdown(self) -> None:
        """Release the TP group's communicator and leave the process group (more than one rank)."""
        if self.world_size > 1:
            destroy_model_parallel()
            destroy_distributed_environment()
            self.tp_group = None
