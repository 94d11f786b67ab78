"""``EngineConfig``: every engine knob and plugin choice of one run, with vLLM's names."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PLUGIN_FIELDS = ("scheduler", "kv_allocator", "attention", "drafter", "quant", "grammar", "executor", "router",
                 "lora_backend", "kv_connector")
#: fields set from the ``lora:`` section of the Hydra config (config key -> EngineConfig field; vLLM's names)
LORA_FIELDS = {"enable": "enable_lora", "max_loras": "max_loras", "max_lora_rank": "max_lora_rank",
               "max_cpu_loras": "max_cpu_loras", "modules": "lora_modules",
               "allow_runtime_updates": "allow_runtime_lora_updates"}
#: fields set from the ``kv_transfer:`` section (config key -> EngineConfig field; vLLM's KVTransferConfig names)
KV_TRANSFER_FIELDS = {"role": "kv_role", "load_failure_policy": "kv_load_failure_policy",
                      "params": "kv_transfer_link_params"}
COMPILE_MODES = ("auto", "true", "false")
#: fields set from the ``parallel:`` section of the Hydra config (not ``engine.*``)
PARALLEL_FIELDS = ("tensor_parallel_size", "data_parallel_size", "num_threads_per_rank", "communicator",
                   "pipeline_parallel_size", "enable_expert_parallel", "pp_layer_partition", "all2all_backend",
                   "enable_eplb", "num_redundant_experts", "eplb_step_interval")
#: fields set from the ``disagg:`` section (config key -> EngineConfig field): prefill/decode disaggregation
DISAGG_FIELDS = {"prefill_replicas": "disagg_prefill_replicas"}
COMMUNICATORS = ("auto", "shm", "torch_distributed")


@dataclass
class EngineConfig:
    """Resolved configuration of one engine.

    Plugin choices are registry names (``scheduler="priority"``) with their parameters in the
    matching ``*_params`` dict. Engine knobs keep vLLM's names and units.
    """

    model: str  # local HF folder, hub id (cache only, no download) or "smollm2"
    dtype: str = "auto"  # auto (the checkpoint's config.json dtype, float32 if it names none) | float32 | bfloat16 | float16
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    tokenizer: str | None = None  # defaults to the model path
    scheduler: str = "fcfs"
    scheduler_params: dict[str, Any] = field(default_factory=dict)
    kv_allocator: str = "paged"
    kv_allocator_params: dict[str, Any] = field(default_factory=dict)
    attention: str = "torch_paged"
    attention_params: dict[str, Any] = field(default_factory=dict)
    drafter: str = "none"
    drafter_params: dict[str, Any] = field(default_factory=dict)
    quant: str = "none"
    quant_params: dict[str, Any] = field(default_factory=dict)
    grammar: str = "xgrammar"
    grammar_params: dict[str, Any] = field(default_factory=dict)
    executor: str = "auto"  # auto (uniproc for one rank, mp for more) | uniproc | mp | ray
    executor_params: dict[str, Any] = field(default_factory=dict)
    tensor_parallel_size: int = 1  # ranks the model is sharded over (torch.distributed: gloo on CPU, NCCL on CUDA)
    data_parallel_size: int = 1  # engine replicas behind one front (each with its own scheduler, KV cache, executor)
    router: str = "least_loaded"  # which replica serves a request (data_parallel_size > 1): a router plugin name
    # stages the layers are split over (GPipe-style); priced by executor=sim (docs/simulator.md), the real executors run 1
    pipeline_parallel_size: int = 1
    # layers per pipeline stage, e.g. "3,2" (vLLM's VLLM_PP_LAYER_PARTITION); "" = vLLM's get_pp_indices split
    pp_layer_partition: str = ""
    # MoE experts partitioned over the tensor-parallel ranks (all-to-all dispatch) instead of sharded; executor=sim
    # prices it, mp / ray run it (framework/model_executor/expert_parallel.py, docs/parallelism.md)
    enable_expert_parallel: bool = False
    all2all_backend: str = "allgather_reducescatter"  # EP combine (vLLM's names): allgather_reducescatter | naive
    enable_eplb: bool = False  # EP: rebalance experts over the ranks from measured loads (DeepSeek's EPLB)
    num_redundant_experts: int = 0  # EP: extra expert slots holding replicas of hot experts (needs enable_eplb)
    eplb_step_interval: int = 3000  # EP: model forwards (engine steps) between EPLB rebalances
    # P/D disaggregation: of the data_parallel_size replicas, this many prefill (0: colocated); docs/simulator.md
    disagg_prefill_replicas: int = 0
    router_params: dict[str, Any] = field(default_factory=dict)
    # multi-LoRA serving (docs/lora.md; vLLM's --enable-lora --max-loras --max-lora-rank --max-cpu-loras --lora-modules)
    enable_lora: bool = False  # requests may carry a LoRARequest; target linears get LoRA slots
    max_loras: int = 1  # adapters one step may hold (device slots)
    max_lora_rank: int = 16  # largest adapter rank accepted (slot width)
    max_cpu_loras: int | None = None  # adapters kept loaded in the CPU LRU cache; None -> max_loras
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapter name -> PEFT folder, known at start
    # the server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updates: bool = False
    lora_backend: str = "bgmv"  # the batched LoRA computation: a lora_backend plugin name (bgmv | sgmv | loop)
    lora_backend_params: dict[str, Any] = field(default_factory=dict)
    # KV transfer (docs/kv_transfer.md; vLLM's KVTransferConfig: kv_connector, kv_connector_extra_config, kv_role,
    # kv_load_failure_policy)
    kv_connector: str = "none"  # a kv_connector plugin name (none | shared_storage | offload | multi)
    kv_connector_params: dict[str, Any] = field(default_factory=dict)
    kv_role: str = "kv_both"  # kv_producer (stores KV) | kv_consumer (loads KV) | kv_both
    kv_load_failure_policy: str = "recompute"  # a block that fails to load: recompute its tokens | fail the request
    # the P/D transfer link as executor=sim prices it (kv_transfer.params: bandwidth_gbps, latency_s; docs/simulator.md)
    kv_transfer_link_params: dict[str, Any] = field(default_factory=dict)
    num_threads_per_rank: int = 0  # torch threads per rank; 0 = cores / tensor_parallel_size (at most $OMP_NUM_THREADS) in worker processes (uniproc: unchanged)
    # TP collectives: shm (shared memory, CPU ranks on one host) | torch_distributed (gloo / NCCL) | auto (shm where it can)
    communicator: str = "auto"
    max_num_seqs: int = 256  # max requests in one step's batch
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output cap, tokens; None -> model's max positions
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; overrides kv_cache_memory_bytes when set
    kv_cache_memory_bytes: int = 1 << 30  # KV cache budget when num_blocks is None, bytes
    kv_cache_dtype: str = "auto"  # auto (model dtype) | int8 | fp8_e4m3: quantized K/V + per token-head scales
    # MLA models (DeepSeek-V2/V3): cache the latent [c_kv, k_rope] per token and layer and absorb the up-projections
    # (framework/model_executor/mla.py); false caches K/V expanded per head (the ablation)
    mla_latent_cache: bool = True
    enable_prefix_caching: bool = True  # hash-chain prefix reuse in the allocator
    long_prefill_token_threshold: int = 0  # cap per-request prefill chunk, tokens; 0 disables
    seed: int = 0  # engine RNG seed (requests without their own seed)
    preemption_mode: str = "recompute"  # recompute | swap (KV blocks to a CPU swap space and back)
    swap_space_bytes: int = 0  # CPU swap space for preemption_mode=swap, bytes
    # auto | true | false (a bool is normalized): torch.compile (inductor) the decoder; auto compiles for a
    # server and for offline work past the break-even (framework/compilation/policy.py); eager with a
    # warning if it cannot
    compile: bool | str = "auto"
    compile_freezing: bool = False  # inductor freezing: weights as constants, prepacked for oneDNN on CPU
    # what runs dynamo's graphs (vLLM's compilation_config.backend): inductor (generated kernels) | eager (the
    # traced FX graphs run as they are: same tracing, guards and layer loop, no code generation; for debugging)
    compile_backend: str = "inductor"
    # decode CUDA graphs (framework/compilation/cuda_graphs.py): True never captures; None (default) captures where it
    # can (CUDA, a backend with supports_cuda_graphs, one rank); False insists (refused before loading if it cannot)
    enforce_eager: bool | None = None
    prepack_linears: str = "auto"  # auto | on | off: oneDNN-prepacked (and fused q/k/v, gate/up) CPU linears (auto: CPU, unless compile_freezing)
    tune_malloc: bool = True  # CPU: glibc mallopt so large activations reuse heap memory instead of fresh page-faulted mmaps
    # an engine step (scheduling, plugins' hooks, the forward) running longer than this is hung: a server's
    # engine loop dies (503s, exit 1), an offline run dumps every thread's stack; above the executor's step deadline
    watchdog_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool):
            self.compile = "true" if self.compile else "false"
        if self.executor == "auto":  # as vLLM's ParallelConfig: one rank in-process, several in processes; CPU
            # data-parallel replicas in one process (offline LLM) put their ranks in worker processes pinned to
            # disjoint cores, so that the replicas compute at once (framework/engine/data_parallel.py)
            one_process = self.tensor_parallel_size * self.pipeline_parallel_size == 1 and (self.data_parallel_size == 1
                                                              or not self.device.startswith("cpu"))
            self.executor = "uniproc" if one_process else "mp"
        self.validate()

    def validate(self) -> None:
        """Check knob ranges.

        Raises:
            ValueError: naming the knob and its accepted range.
        """
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}"),
            (self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"),
            (self.compile_backend in ("inductor", "eager"),
             f"compile_backend must be inductor or eager, got {self.compile_backend!r}"),
            (self.kv_cache_dtype in ("auto", "int8", "fp8_e4m3"),
             f"kv_cache_dtype must be auto, int8 or fp8_e4m3, got {self.kv_cache_dtype!r}"),
            (self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}"),
            (self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}"),
            (self.kv_cache_memory_bytes >= 1, f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}"),
            (self.long_prefill_token_threshold >= 0,
             f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"),
            (self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2, got {self.max_model_len}"),
            (self.preemption_mode in ("recompute", "swap"),
             f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}"),
            (self.preemption_mode != "swap" or self.swap_space_bytes > 0,
             "preemption_mode=swap needs engine.swap_space_bytes > 0 (e.g. 1073741824 for 1 GiB of CPU swap)"),
            (self.swap_space_bytes >= 0, f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}"),
            (str(self.compile) in COMPILE_MODES, f"compile must be auto, true or false, got {self.compile!r}"),
            (self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"),
            (self.data_parallel_size >= 1, f"data_parallel_size must be >= 1, got {self.data_parallel_size}"),
            (self.pipeline_parallel_size >= 1,
             f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"),
            (self.executor != "uniproc" or not self.enable_expert_parallel,
             "parallel.enable_expert_parallel splits experts over tensor-parallel ranks in worker processes: use "
             "executor=mp (or ray, or auto), or executor=sim to price it"),
            (self.executor == "sim" or self.disagg_prefill_replicas == 0 or self.kv_connector != "none",
             "disagg.prefill_replicas needs a KV connector to move each prompt's KV from its prefill replica to its "
             "decode replica: add kv_connector=zmq (or kv_connector=shared_storage kv_connector.params.path=DIR); "
             "executor=sim prices the transfer without one (docs/kv_transfer.md)"),
            (self.pipeline_parallel_size == 1 or self.executor in ("sim", "mp", "ray"),
             f"parallel.pipeline_parallel_size={self.pipeline_parallel_size} runs its stages in worker processes: "
             f"use executor=mp (or ray, or auto), not executor={self.executor}"),
            (self.disagg_prefill_replicas == 0 or 0 < self.disagg_prefill_replicas < self.data_parallel_size,
             f"disagg.prefill_replicas must be 0 (colocated) or in [1, data_parallel_size - 1] (the rest decode), "
             f"got {self.disagg_prefill_replicas} with data_parallel_size={self.data_parallel_size}"),
            (self.watchdog_timeout_s > 0, f"watchdog_timeout_s must be > 0 seconds, got {self.watchdog_timeout_s}"),
            (self.num_threads_per_rank >= 0,
             f"num_threads_per_rank must be >= 0 (0: cores / tensor_parallel_size), got {self.num_threads_per_rank}"),
            (self.communicator in COMMUNICATORS,
             f"communicator must be auto, shm or torch_distributed, got {self.communicator!r}"),
            (self.communicator != "shm" or not self.device.startswith("cuda"),
             "parallel.communicator=shm is for CPU ranks; on CUDA use auto or torch_distributed (NCCL)"),
            (self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}"),
            (self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}"),
            (self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             f"max_cpu_loras must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"),
            (self.kv_role in ("kv_producer", "kv_consumer", "kv_both"),
             f"kv_transfer.role must be kv_producer, kv_consumer or kv_both, got {self.kv_role!r}"),
            (self.kv_load_failure_policy in ("recompute", "fail"),
             f"kv_transfer.load_failure_policy must be recompute or fail, got {self.kv_load_failure_policy!r}"),
            (self.prepack_linears in ("auto", "on", "off"),
             f"prepack_linears must be auto, on or off, got {self.prepack_linears!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Invalid engine config: {message}")

    def plugin_params(self, kind: str) -> dict[str, Any]:
        """Parameters of the plugin chosen for ``kind`` (one of ``PLUGIN_FIELDS``)."""
        return dict(getattr(self, f"{kind}_params"))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, for saving and tracking."""
        return asdict(self)
