"""The model's decoder compiled by ``torch.compile`` (inductor), one decoder layer at a time:
``engine.compile=true``, or ``auto`` where the work ahead pays for it (``framework/compilation/policy.py``).

What is compiled are the decoder's layers (``framework/compilation/regions.py``): layers of one
kind (the same code on different weights and KV caches: all 30 of SmolLM2) share one graph per step
key, so a cold compile traces, lowers and builds one layer instead of the whole stack (SmolLM2 bf16,
2-core CPU: ~390 s for the whole decoder before, ~20 s for its three layer graphs now, a few seconds
from inductor's on-disk cache). Once a step shape has run, its later steps call the layers' graphs as
one loop from the first layer's call (``framework/compilation/layer_stack.py``: no per-layer module call,
dispatch or dynamo bytecode; ~0.5-0.8 ms of a ~14 ms SmolLM2 batch-1 step). The embedding, the rotary
tables and the final norm run eagerly; the
LM head runs on the sampled rows only, eagerly, except for one row (batch-1 decode, a lone prefill),
which has a small compiled graph of its own (:meth:`CompiledDecoder.logits`). Attention inside a
layer graph is the opaque custom op ``torch.ops.servelab.attention`` (``framework/model_executor/forward_context.py``), so the backend, its
metadata and the paged KV cache stay outside dynamo; the layer's identity is a tensor argument of it.

``num_tokens`` is dynamic in the graphs of more than one token; dynamo specialises size 1, so a step
with one token (batch-1 decode) has a graph of its own. When the attention backend can be traced
(``traceable_inputs``, e.g. ``torch_paged`` on steps whose tokens are all decodes), those steps call
the decoder with a ``servelab_graph`` keyword and get graphs of their own, with attention inside
them. :meth:`CompiledDecoder.warm_up` therefore runs a prefill, a 1-token step and a decode step of
many requests at start-up (:data:`WARM_UP_STEPS`; 2 graphs per layer kind for an opaque backend, 3
for a traceable one, plus the one-row LM head's): after it, every batch size reuses one of those graphs, and
:class:`CompileStats` counts any later compilation as a recompile. In the 1-token graph the linears
are traced GEMVs (``framework/model_executor/prepack.py``), so that graph is one stretch of generated code
with no extern call.

Compilation is inference-only: the runner compiles under ``torch.inference_mode`` (AOT autograd
traces no backward), and inductor's FX graph cache and AOT autograd's cache (both on by default, in
``$TORCHINDUCTOR_CACHE_DIR``) let a later process skip lowering and C++ compilation; what a later
process still does is dynamo's trace of one layer per graph.

If the compiler is unavailable (no C++ compiler for inductor on CPU) or compiling fails, a warning
names the cause and the runner goes on eagerly (same outputs, uncompiled speed).

Under tensor parallelism every rank compiles its own shard's layers (the all-reduces are custom ops
inside the graphs). Ranks decide together: after the warm-up,
:meth:`CompiledDecoder.agree_across_ranks` makes every rank eager when any one fell back (naming
that rank's reason), and past the warm-up a rank never falls back alone: a failing compiled call
raises instead, since a rank that reran the step eagerly could have issued some collectives twice
and the group's collectives would no longer line up.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.compilation import vec_isa
from framework.compilation.regions import (
    LayerGraphs,
    LayerHandle,
    WeakBackend,
    decoder_layers,
    layer_kinds,
    step_key_name,
    with_own_code,
)
from framework.model_executor.forward_context import GraphAttention, prepared_mask
from framework.model_executor.model_families import output_logits

logger = logging.getLogger(__name__)
#: Dummy steps of the warm-up, ``(num_tokens, num_reqs)``: a 512-token prefill (the dynamic graph), a
#: 1-token step (size 1 is specialised by dynamo) and a 64-request decode step (the traced-attention
#: graph of a traceable backend; the prefill graph again for an opaque one). The sizes are inductor's
#: size hints for the dynamic ``num_tokens``: it decides from them which generated loops run in
#: parallel, so with 2-token examples every per-token loop (RMSNorm, RoPE, activations, residuals,
#: the K/V write) ran on one thread at batch 64 (compiled decode step ~108 -> ~88 ms, SmolLM2 bf16).
#: The model runner caps the prefill at its cache's slots.
WARM_UP_STEPS = ((512, 1), (1, 1), (64, 64))
#: inductor settings of every compiled decoder graph (with ``freezing``). No per-load bounds checks on indirect indexing: token ids
#: are checked at ``add_request`` and block ids come from the allocator (a traced paged-attention
#: kernel loads through them). No size, stride, alignment or scalar asserts in the Python wrapper:
#: the dispatch to a graph (``compile_regions.LayerGraphs``) is by the step's shape, and the
#: asserts were ~400 Python calls per decode step (13 per layer, plus the extern GEMMs' outputs).
INDUCTOR_CONFIG = {"assert_indirect_indexing": False, "size_asserts": False, "alignment_asserts": False,
                  "scalar_asserts": False}
#: Added for graphs that compute in bfloat16/float16 (:func:`inductor_config`): inductor compiles its
#: C++ with ``-ffp-contract=off``; ``fast`` lets the compiler fuse each multiply and add into one FMA.
#: The in-place paged attention kernel (float32 arithmetic on bf16 K/V) took ~5% less time (batch 64,
#: context 190, 2-core CPU). float32 graphs keep ``off``: their outputs are compared token for token
#: with transformers, and an FMA rounds once where eager rounds twice.
REDUCED_PRECISION_CONFIG = {"cpp.enable_floating_point_contract_flag": "fast"}
#: Bytes of LM head weight from which a one-row head is compiled (:meth:`CompiledDecoder.logits`): a
#: compiled call costs ~30 us of guards and wrappers, which a head of a few MiB does not win back
#: (SmolLM2's is 56 MiB in bf16, a 1B Llama's 0.5 GiB; the suite's tiny models stay eager).
COMPILED_HEAD_MIN_BYTES = 16 << 20


def inductor_config(example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The inductor config patches of a graph: :data:`INDUCTOR_CONFIG`, plus
    :data:`REDUCED_PRECISION_CONFIG` when any floating-point input (activations, weights, the KV
    cache) is bfloat16 or float16, plus, for a graph with CPU tensors, ``cpp.simdlen`` pinned to the vector width
    inductor picks here (:func:`cpu_simdlen`)."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    reduced = any(x.dtype in (torch.bfloat16, torch.float16) for x in tensors)
    simdlen = {"cpp.simdlen": cpu_simdlen()} if any(x.device.type == "cpu" for x in tensors) else {}
    return {**INDUCTOR_CONFIG, **(REDUCED_PRECISION_CONFIG if reduced else {}), **simdlen}


@functools.cache
def cpu_simdlen() -> int:
    """The vector width in bits of the ISA inductor generates CPU code for in this process (512 for AVX-512 and
    AMX, 256 for AVX2, 0 for none): what it would pick unpinned (``pick_vec_isa``: the best the CPU and compiler
    have, or ``ATEN_CPU_CAPABILITY``'s), so pinning it changes no generated code.

    Why pin it: inductor's FX graph cache key holds its config but not the ISA, and ``ATEN_CPU_CAPABILITY``
    changes the ISA under an unchanged config (``cpp.simdlen=None``). A graph cached as AVX-512 code on a machine
    was then loaded under ``ATEN_CPU_CAPABILITY=avx2`` (CI's AVX2 emulation; an AVX2-only CPU sharing the cache
    folder) and its C++ rebuilt with AVX2 flags: 16-lane loops over 8-lane vectors, NaN or all-zero tokens
    (``tests/framework/compilation/test_isa_cache_key.py``). With the width in the config it is in the key."""
    vec_isa.install()
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return int(pick_vec_isa().bit_width())


@dataclass
class CompileStats:
    """Compile outcome of one engine, reported in ``metrics.json`` (:meth:`as_dict`)."""

    enabled: bool = False  # engine.compile was requested
    active: bool = False  # the compiled forward is in use (False after a fallback to eager)
    compile_s: float = 0.0  # wall time of the start-up warm-up forwards (compilation included; inductor's on-disk cache may shorten it), seconds
    num_graphs: int = 0  # graphs inductor compiled so far (warm-up + later)
    num_graphs_warmup: int = 0  # graphs compiled by the warm-up
    num_layer_kinds: int = 0  # decoder layer kinds, each compiled once per step shape (compile_regions.py)
    num_cache_misses: int = 0  # warm-up graphs inductor generated and built afresh (0: all from its on-disk cache)
    fallback_reason: str | None = None  # why the run went eager ("ExcType: message"); None if it did not
    #: per step key ("1-token traced-attention"...): "stacked" (compile_regions.LayerGraphs runs the layers as one
    #: loop of graph calls, framework/compilation/layer_stack.py) or "per layer: <why>"; filled as each key's first step runs
    layer_stack: dict[str, str] = field(default_factory=dict)

    @property
    def num_recompiles(self) -> int:
        """Graphs compiled after the warm-up (0 when every step reused a warm-up graph)."""
        return self.num_graphs - self.num_graphs_warmup

    def as_dict(self) -> dict[str, Any]:
        """Flat ``metrics.json`` keys: ``compile``, ``compile_active``, ``compile_s``,
        ``compile_num_graphs_warmup``, ``compile_num_layer_kinds``, ``compile_num_cache_misses``,
        ``compile_num_recompiles``, ``compile_fallback``, ``compile_layer_stack``."""
        return {"compile": self.enabled, "compile_active": self.active, "compile_s": self.compile_s,
                "compile_num_layer_kinds": self.num_layer_kinds, "compile_num_cache_misses": self.num_cache_misses,
                "compile_num_graphs_warmup": self.num_graphs_warmup, "compile_num_recompiles": self.num_recompiles,
                "compile_fallback": self.fallback_reason, "compile_layer_stack": dict(self.layer_stack)}


def _inductor_cache_dir() -> str:
    """Where inductor keeps compiled kernels between processes (``$TORCHINDUCTOR_CACHE_DIR`` or its
    default under the temp dir)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 - a private torch helper: the message only loses the path
        return "$TORCHINDUCTOR_CACHE_DIR"


def check_compiler(device: torch.device) -> None:
    """Raise when inductor cannot generate code for ``device`` here.

    Raises:
        torch._inductor.exc.InvalidCxxCompiler: CPU and no C++ compiler from
            ``torch._inductor.config.cpp.cxx`` (``$CXX``, g++, clang++...) is installed.
        RuntimeError: CUDA and triton is not importable.
    """
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise RuntimeError("triton is not installed (inductor's CUDA code generator)")


class CompiledDecoder:
    """The decoder of a transformers ``*ForCausalLM`` with its layers compiled, one graph per layer kind
    and step key (``framework/compilation/regions.py``), with eager fallback.

    Each decoder layer's ``forward`` is replaced on the instance by a call into
    :class:`~framework.compilation.regions.LayerGraphs` with the layer's
    :class:`~framework.compilation.regions.LayerHandle`; the rest of the decoder runs eagerly.
    Call it inside ``forward_context`` (the model runner does).

    Args:
        model: a transformers ``*ForCausalLM`` loaded with ``attn_implementation="servelab"``: its
            decoder is ``model.get_decoder()`` (``model.model``; GPT-2's ``transformer``, GPT-NeoX's
            ``gpt_neox``) with one ``nn.ModuleList`` of ``num_hidden_layers`` layers, its LM head
            ``model.get_output_embeddings()``, applied eagerly with what the wrapper adds after it
            (``framework.model_executor.model_families.output_logits``: Gemma's final softcap...).
        kv_caches: per decoder layer, its KV cache tensor (``backend.get_kv_cache_shape``; may be shared).
        layer_group: per decoder layer, its KV cache group.
        call_signatures: per decoder layer, the attention call the backend was built for
            (``AttentionBackend.call_signatures``; empty: every layer alike).
        freezing: inductor ``freezing``: weights become graph constants, so inductor can
            constant-fold them and, on CPU, prepack linear weights for oneDNN. A frozen graph holds
            one layer's weights, so every layer is a kind of its own (no reuse: the compile takes as
            long as the whole decoder's did). Weights must not change after the warm-up (quant
            transforms run before, so they are frozen as quantized).
        compile_backend: ``inductor`` (generated kernels) or ``eager``: the traced FX graphs run as they are
            (same tracing, guards, graph counts and layer loop; no code generation), vLLM's
            ``compilation_config.backend="eager"``.
        tensor_parallel: this is one rank of a tensor-parallel group (``torch.distributed``
            initialised, the default group the TP group): fall back only jointly
            (:meth:`agree_across_ranks`), never alone after the warm-up.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: Sequence[torch.Tensor], layer_group: Sequence[int],
                 call_signatures: Sequence[tuple] = (), freezing: bool = False, tensor_parallel: bool = False,
                 compile_backend: str = "inductor") -> None:
        self.model = model
        self.freezing = freezing
        self.compile_backend = compile_backend
        self.tensor_parallel = tensor_parallel
        self.stats = CompileStats(enabled=True)
        self.graphs: LayerGraphs | None = None
        self._warmed_up = False
        self._step_key: tuple = ()  # this step's dispatch key: (num_tokens == 1, attention traced)
        self._expected_graphs = 0  # graphs the warm-up compiles (progress lines)
        self._t0 = time.perf_counter()
        self._head: Callable[[torch.Tensor], torch.Tensor] | None = None  # the compiled one-row LM head
        try:
            self._install(kv_caches, layer_group, call_signatures)
        except ValueError as err:
            self._fall_back(str(err))

    def _install(self, kv_caches: Sequence[torch.Tensor], layer_group: Sequence[int],
                 call_signatures: Sequence[tuple]) -> None:
        """Group the layers into kinds and route each layer's ``forward`` to its kind's graphs.

        Raises:
            ValueError: the model has no separate decoder and LM head, no single stack of layers, or a
                layer whose ``forward`` is already replaced on the instance.
        """
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else None
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if not (isinstance(decoder, torch.nn.Module) and decoder is not self.model and isinstance(head, torch.nn.Module)):
            raise ValueError(f"{type(self.model).__name__} has no separate decoder (get_decoder) and LM head "
                             "(get_output_embeddings)")
        layers = decoder_layers(decoder, self.model.config.get_text_config().num_hidden_layers)
        if any("forward" in vars(layer) for layer in layers):
            raise ValueError("a decoder layer's forward is already replaced on the instance")
        # the KV cache group is not part of a kind: LayerGraphs hands each layer its group's inputs
        extra = [(call_signatures[i] if i < len(call_signatures) else None, i if self.freezing else None)
                 for i in range(len(layers))]
        kinds = layer_kinds(layers, extra)
        first: dict[int, int] = {}
        handles = [LayerHandle(torch.tensor(i), kv_caches[i], layer_group[i], first.setdefault(kind, i))
                   for i, kind in enumerate(kinds)]
        self.decoder = decoder
        self.graphs = LayerGraphs(layers, kinds, handles, self._backend)
        self.stats.num_layer_kinds = self.graphs.num_kinds
        self.stats.layer_stack = self.graphs.layer_stack
        for i, layer in enumerate(layers):
            layer.forward = functools.partial(self._layer_forward, i)
        if self.tensor_parallel:  # the eager head gathers the logits to the driver only: a compiled one
            return                # all-gathers, and a rank whose head fell back would then deadlock the group
        if sum(p.numel() * p.element_size() for p in head.parameters()) < COMPILED_HEAD_MIN_BYTES:
            return
        model = self.model

        def one_row_logits(rows: torch.Tensor) -> torch.Tensor:
            return output_logits(model, rows)

        self._head = torch.compile(with_own_code(one_row_logits, "lm_head"), dynamic=False, fullgraph=True,
                                   backend=WeakBackend(self._backend, label="one-row LM head"))

    def _layer_forward(self, i: int, *args: Any, **kwargs: Any) -> Any:
        """Layer ``i``'s ``forward``: its kind's graph for this step (eagerly after a fallback)."""
        try:
            return self.graphs.run(i, self._step_key, args, kwargs)
        except Exception as err:  # noqa: BLE001 - compile errors surface at the call; this layer reruns eagerly
            if self.tensor_parallel and self._warmed_up:
                raise RuntimeError(
                    f"torch.compile failed on a tensor-parallel rank after the warm-up ({type(err).__name__}: "
                    f"{err}); one rank cannot fall back to eager alone (its collectives would no longer line up "
                    "with the other ranks'): restart with engine.compile=false") from err
            # rerunning is safe: a partial layer wrote K/V only at this step's own slots, and the eager
            # layer writes the same values there again (under TP, during the warm-up, a trace-time
            # failure ran no collective; agree_across_ranks then makes every rank eager)
            layer = self.graphs.layers[i]
            self._fall_back(f"torch.compile failed ({type(err).__name__}: {err})")
            return type(layer).forward(layer, *args, **kwargs)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any], label: str | None = None) -> Any:
        """Inductor, counting compiled graphs in ``stats.num_graphs`` and logging each one (``label``:
        what the graph is, by default this step's layer graph)."""
        from torch._inductor.compile_fx import compile_fx

        vec_isa.install()  # inductor's per-process ISA probes, answered from this machine's record

        self.stats.num_graphs += 1
        step = label or f"{step_key_name(self._step_key)} step"
        if self._warmed_up:  # the warm-up should have covered every step shape: say which one did not
            logger.warning("engine.compile: recompiling after the warm-up (graph %d: %s)",
                           self.stats.num_graphs, step)
        compiled = gm if self.compile_backend == "eager" else compile_fx(
            gm, example_inputs, config_patches={"freezing": self.freezing, **inductor_config(example_inputs)})
        if not self._warmed_up:
            logger.info("engine.compile: graph %d of %d compiled (%s), %.1f s so far", self.stats.num_graphs,
                        self._expected_graphs, step, time.perf_counter() - self._t0)
        return compiled

    def _fall_back(self, reason: str) -> None:
        self.stats.active = False
        self.stats.fallback_reason = reason
        if self.graphs is not None:
            for layer in self.graphs.layers:
                vars(layer).pop("forward", None)  # the class's forward again
            self.graphs = None
        self._head = None
        logger.warning("engine.compile: %s; running the model eagerly (same outputs, uncompiled speed)", reason)

    @property
    def compiling(self) -> bool:
        """The layers run through their compiled graphs (not fallen back to eager)."""
        return self.graphs is not None

    def warm_up(self, run_forward: Callable[[int, int], Any], device: torch.device, traced_attention: bool = True) -> None:
        """Compile at start-up: check the compiler, then run the dummy steps of :data:`WARM_UP_STEPS`,
        logging each graph as it is compiled (``graph k of n``, seconds so far).

        Args:
            run_forward: ``run_forward(num_tokens, num_reqs)`` runs one dummy step (``num_reqs``
                requests sharing ``num_tokens`` tokens) through :meth:`__call__` inside a forward
                context, choosing the traced-attention path as a real step would (the model runner's).
            device: the model's device (which code generator inductor needs).
            traced_attention: the backend traces attention into decode steps' graphs (3 step keys
                per layer kind; 2 for an opaque backend): the ``n`` of the progress lines.
        """
        if not self.compiling:
            return
        try:
            check_compiler(device)
        except Exception as err:  # noqa: BLE001 - any reason the compiler is missing means eager
            self._fall_back(f"compiler unavailable ({type(err).__name__}: {err})")
            return
        self.stats.active = True
        shapes = 3 if traced_attention else 2
        self._expected_graphs = self.stats.num_layer_kinds * shapes + (self._head is not None)
        logger.info("engine.compile: compiling %d graph(s): %d decoder layer kind(s) of %d layers x %d step shapes%s "
                    "(inductor's on-disk cache: %s)", self._expected_graphs, self.stats.num_layer_kinds,
                    len(self.graphs.layers), shapes, ", and the one-row LM head" if self._head is not None else "",
                    _inductor_cache_dir())
        # imported here: dynamo costs ~1.5 s to import, and an eager process never needs it
        from torch._dynamo.utils import counters

        self._t0 = t0 = time.perf_counter()
        misses = counters["inductor"]["fxgraph_cache_miss"]
        for num_tokens, num_reqs in WARM_UP_STEPS:
            run_forward(num_tokens, num_reqs)
        self.stats.compile_s = time.perf_counter() - t0
        self.stats.num_cache_misses = counters["inductor"]["fxgraph_cache_miss"] - misses
        self.stats.num_graphs_warmup = self.stats.num_graphs
        self._warmed_up = True
        if self.stats.active and self.stats.num_graphs == 0:
            # dynamo ran the frames eagerly without calling the backend (e.g. torch._dynamo's
            # recompile_limit, 8 graphs per code object, reached)
            self._fall_back("dynamo compiled no graph during the warm-up (recompile_limit reached?)")
        if self.stats.active:
            logger.info("engine.compile: %d graphs compiled in %.1f s", self.stats.num_graphs, self.stats.compile_s)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_index: torch.Tensor,
                 graph: GraphAttention | None = None) -> torch.Tensor:
        """Logits of the sampled rows.

        Args:
            input_ids, position_ids: ``(1, num_tokens)`` int64.
            logits_index: ``(num_sample_rows,)`` int64 token positions whose logits are needed.
            graph: attention traced into the layer graphs for this step (``None``: the opaque op).

        Returns:
            ``(num_sample_rows, vocab_size)`` logits in the model dtype.
        """
        hidden = self.hidden_states(input_ids, position_ids, graph)
        if hidden is not None:
            return self.logits(hidden[logits_index])
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          attention_mask=prepared_mask(input_ids.device), logits_to_keep=logits_index).logits[0]

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head's logits ``(num_rows, vocab_size)`` (model dtype) of decoder hidden states ``rows``
        ``(num_rows, hidden_size)`` (``output_logits``): one row (batch-1 decode, a lone prefill) through
        its own compiled graph, where the head is a traced GEMV (``framework/model_executor/prepack.py``) that
        streams the weight at inductor's loop speed instead of oneDNN's one-row GEMM (SmolLM2 bf16, 2-core
        CPU: batch-1 step 14.1 -> 13.6 ms, paired runs). Eagerly: more rows, a head under
        :data:`COMPILED_HEAD_MIN_BYTES`, tensor parallelism (the eager head gathers the logits to the
        driver rank only), or once the head's compile failed (a warning says why; the layers stay compiled).
        """
        if self._head is not None and rows.shape[0] == 1:
            try:
                return self._head(rows)
            except Exception as err:  # noqa: BLE001 - a failed trace ran nothing: the eager head gives the same logits
                self._head = None
                logger.warning("engine.compile: the one-row LM head did not compile (%s: %s); it runs eagerly",
                               type(err).__name__, err)
        return output_logits(self.model, rows)

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      graph: GraphAttention | None = None) -> torch.Tensor | None:
        """The decoder's last hidden states ``(num_tokens, hidden_size)`` (model dtype) through the
        compiled layers (``graph``: as in :meth:`__call__`); ``None`` once compilation has fallen back
        to eager (the caller runs eagerly, through the backend's ``forward``)."""
        if not self.compiling:
            return None
        extra = {} if graph is None else {"servelab_graph": graph}
        self._step_key = (input_ids.shape[1] == 1, graph is not None)
        return self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                            attention_mask=prepared_mask(input_ids.device), **extra).last_hidden_state[0]

    def agree_across_ranks(self) -> None:
        """Tensor parallelism, after :meth:`warm_up` on every rank: when any rank of the default
        ``torch.distributed`` group fell back to eager, every rank does, with that rank's reason
        (one ``all_gather_object`` of ``(active, reason)``). Called by every rank, or none."""
        import torch.distributed as dist

        states: list[tuple[bool, str | None] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(states, (self.stats.active, self.stats.fallback_reason))
        failed = [(rank, reason) for rank, (active, reason) in enumerate(states) if not active]
        if failed and self.stats.active:
            rank, reason = failed[0]
            self._fall_back(f"tensor-parallel rank {rank} fell back ({reason}), so every rank runs eagerly")


