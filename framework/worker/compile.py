"""The model's decoder stack compiled once by ``torch.compile`` (inductor): ``engine.compile=true``, or
``auto`` once the work ahead pays for it (``framework/engine/compile_policy.py``).

What is compiled is the transformers decoder (``model.get_decoder()``: embeddings, decoder layers, final
norm), not the ``*ForCausalLM`` wrapper: the LM head runs eagerly on the sampled rows only, so the
compiled graph has one dynamic size, ``num_tokens``, and the number of sampled rows (0, 1 or many
per step) never forces a recompile. Attention inside the graph is the opaque custom op
``torch.ops.servelab.attention`` (``framework/worker/forward_context.py``), so the backend, its metadata
and the paged KV cache stay outside dynamo.

``num_tokens`` is marked dynamic; dynamo still specialises size 1, so a step with one token (batch-1
decode) has its own graph. When the attention backend can be traced (``traceable_inputs``, e.g.
``torch_paged`` on steps whose tokens are all decodes), those steps call the decoder with a
``servelab_graph`` keyword and get graphs of their own, with attention inside them.
:meth:`CompiledDecoder.warm_up` therefore runs a prefill, a 1-token step and a decode step of many
requests at start-up (:data:`WARM_UP_STEPS`; 2 graphs for an opaque backend, 3 for a traceable one):
after it, every batch size reuses one of those graphs, and :class:`CompileStats` counts any later
compilation as a recompile. In the 1-token graph the linears are traced GEMVs
(``framework/worker/prepack.py``), so that graph is one stretch of generated code with no extern call.

If the compiler is unavailable (no C++ compiler for inductor on CPU) or compiling fails, a warning
names the cause and the runner goes on eagerly (same outputs, uncompiled speed).

Under tensor parallelism every rank compiles its own shard's decoder (the all-reduces are
functional collectives inside the graph). Ranks decide together: after the warm-up,
:meth:`CompiledDecoder.agree_across_ranks` makes every rank eager when any one fell back (naming
that rank's reason), and past the warm-up a rank never falls back alone: a failing compiled call
raises instead, since a rank that reran the step eagerly could have issued some collectives twice
and the group's collectives would no longer line up.
"""

from __future__ import annotations

import itertools
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental import _config as fx_config

from framework.worker.forward_context import GraphAttention
from framework.worker.model_families import output_logits

logger = logging.getLogger(__name__)
#: Dummy steps of the warm-up, ``(num_tokens, num_reqs)``: a 512-token prefill (the dynamic graph), a
#: 1-token step (size 1 is specialised by dynamo) and a 64-request decode step (the traced-attention
#: graph of a traceable backend; the prefill graph again for an opaque one). The sizes are inductor's
#: size hints for the dynamic ``num_tokens``: it decides from them which generated loops run in
#: parallel, so with 2-token examples every per-token loop (RMSNorm, RoPE, activations, residuals,
#: the K/V write) ran on one thread at batch 64 (compiled decode step ~108 -> ~88 ms, SmolLM2 bf16).
#: The model runner caps the prefill at its cache's slots.
WARM_UP_STEPS = ((512, 1), (1, 1), (64, 64))
#: What a user waits for at the first compile of a model, from docs/results.md (SmolLM2-135M bf16,
#: 2-core AMD EPYC, 2026-11-25/26: 360-394 s with a fresh inductor cache, 44 s from it); shown in the
#: progress line.
FIRST_COMPILE_HINT = "~6.5 min for SmolLM2-135M on a 2-core CPU (2026-11-25), ~45 s from the cache"
#: inductor settings of every compiled decoder graph (with ``freezing``). No per-load bounds checks on indirect indexing: token ids
#: are checked at ``add_request`` and block ids come from the allocator (a traced paged-attention
#: kernel loads through them). No size, stride, alignment or scalar asserts in the Python wrapper:
#: dynamo's guards already check every input's sizes and strides before the graph runs, and the
#: asserts were ~400 Python calls per decode step (13 per layer, plus the extern GEMMs' outputs).
INDUCTOR_CONFIG = {"assert_indirect_indexing": False, "size_asserts": False, "alignment_asserts": False,
                  "scalar_asserts": False}
#: Added for graphs that compute in bfloat16/float16 (:func:`inductor_config`): inductor compiles its
#: C++ with ``-ffp-contract=off``; ``fast`` lets the compiler fuse each multiply and add into one FMA.
#: The in-place paged attention kernel (float32 arithmetic on bf16 K/V) took ~5% less time (batch 64,
#: context 190, 2-core CPU). float32 graphs keep ``off``: their outputs are compared token for token
#: with transformers, and an FMA rounds once where eager rounds twice.
REDUCED_PRECISION_CONFIG = {"cpp.enable_floating_point_contract_flag": "fast"}
_ENTRY_IDS = itertools.count()


def inductor_config(example_inputs: Sequence[Any]) -> dict[str, Any]:
    """The inductor config patches of a graph: :data:`INDUCTOR_CONFIG`, plus
    :data:`REDUCED_PRECISION_CONFIG` when any floating-point input (activations, weights, the KV
    cache) is bfloat16 or float16."""
    reduced = any(isinstance(x, torch.Tensor) and x.dtype in (torch.bfloat16, torch.float16) for x in example_inputs)
    return {**INDUCTOR_CONFIG, **(REDUCED_PRECISION_CONFIG if reduced else {})}


def decoder_entry(decoder: torch.nn.Module) -> Callable[..., Any]:
    """``decoder(**kwargs)`` as a function with a code object of its own, for ``torch.compile``.

    dynamo keeps its cache of compiled graphs, and their guards, per code object. Compiled directly,
    every engine's decoder shares the cache of the transformers ``forward`` code, so guards must tell
    engines apart (their parameters' dtypes and shapes). Through its own entry, an engine's graphs
    are only ever looked up for its own decoder, which is what lets :class:`CompiledDecoder` drop the
    guards on the decoder's modules and parameters (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``):
    ~450 of them, 0.95 -> 0.21 ms of dynamo cache lookup per SmolLM2 decode step here.

    Args:
        decoder: the module to call (``model.get_decoder()``).

    Returns:
        A function ``entry(**kwargs) -> decoder(**kwargs)`` whose ``__code__`` no other entry shares.
    """
    def entry(**kwargs: Any) -> Any:
        return decoder(**kwargs)

    code = entry.__code__.replace(co_name=f"decoder_entry_{next(_ENTRY_IDS)}")
    return types.FunctionType(code, entry.__globals__, code.co_name, None, entry.__closure__)


@dataclass
class CompileStats:
    """Compile outcome of one engine, reported in ``metrics.json`` (:meth:`as_dict`)."""

    enabled: bool = False  # engine.compile was requested
    active: bool = False  # the compiled forward is in use (False after a fallback to eager)
    compile_s: float = 0.0  # wall time of the start-up warm-up forwards (compilation included; inductor's on-disk cache may shorten it), seconds
    num_graphs: int = 0  # graphs inductor compiled so far (warm-up + later)
    num_graphs_warmup: int = 0  # graphs compiled by the warm-up
    fallback_reason: str | None = None  # why the run went eager ("ExcType: message"); None if it did not

    @property
    def num_recompiles(self) -> int:
        """Graphs compiled after the warm-up (0 when every step reused a warm-up graph)."""
        return self.num_graphs - self.num_graphs_warmup

    def as_dict(self) -> dict[str, Any]:
        """Flat ``metrics.json`` keys: ``compile``, ``compile_active``, ``compile_s``,
        ``compile_num_graphs_warmup``, ``compile_num_recompiles``, ``compile_fallback``."""
        return {"compile": self.enabled, "compile_active": self.active, "compile_s": self.compile_s,
                "compile_num_graphs_warmup": self.num_graphs_warmup, "compile_num_recompiles": self.num_recompiles,
                "compile_fallback": self.fallback_reason}


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
    """The decoder of a transformers ``*ForCausalLM`` under ``torch.compile``, with eager fallback.

    Call it inside ``forward_context`` (the model runner does).

    Args:
        model: a transformers ``*ForCausalLM`` loaded with ``attn_implementation="servelab"``: its
            decoder is ``model.get_decoder()`` (``model.model``; GPT-2's ``transformer``, GPT-NeoX's
            ``gpt_neox``), its LM head ``model.get_output_embeddings()``, applied eagerly with what the
            wrapper adds after it (``framework.worker.model_families.output_logits``: Gemma's final
            softcap...).
        freezing: inductor ``freezing``: weights become graph constants, so inductor can
            constant-fold them and, on CPU, prepack linear weights for oneDNN. Weights must not
            change after the warm-up (quant transforms run before, so they are frozen as quantized).
        tensor_parallel: this is one rank of a tensor-parallel group (``torch.distributed``
            initialised, the default group the TP group): fall back only jointly
            (:meth:`agree_across_ranks`), never alone after the warm-up.
    """

    def __init__(self, model: torch.nn.Module, freezing: bool = False, tensor_parallel: bool = False) -> None:
        self.model = model
        self.freezing = freezing
        self.tensor_parallel = tensor_parallel
        self.stats = CompileStats(enabled=True)
        self._compiled: Callable[..., Any] | None = None
        self._warmed_up = False
        problem = self._unsupported(model)
        if problem is not None:
            self._fall_back(problem)
        else:
            # fullgraph: a graph break would compile the rest under the shared transformers code
            # objects, where the dropped module guards are what tells engines apart; a model with a
            # break fails at its first call and runs eagerly (warned, see __call__)
            self._compiled = torch.compile(
                decoder_entry(model.get_decoder()), backend=self._backend, dynamic=None, fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    @staticmethod
    def _unsupported(model: torch.nn.Module) -> str | None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if not (isinstance(decoder, torch.nn.Module) and decoder is not model and isinstance(head, torch.nn.Module)):
            return f"{type(model).__name__} has no separate decoder (get_decoder) and LM head (get_output_embeddings)"
        return None

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """Inductor, counting compiled graphs in ``stats.num_graphs``."""
        from torch._inductor.compile_fx import compile_fx

        self.stats.num_graphs += 1
        if self._warmed_up:  # the warm-up should have covered every step shape: say which one did not
            shapes = [tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() == 2][:2]
            logger.warning("engine.compile: recompiling after the warm-up (graph %d; 2-D inputs %s)",
                           self.stats.num_graphs, shapes)
        return compile_fx(gm, example_inputs, config_patches={"freezing": self.freezing, **inductor_config(example_inputs)})

    def _fall_back(self, reason: str) -> None:
        self.stats.active = False
        self.stats.fallback_reason = reason
        self._compiled = None
        logger.warning("engine.compile: %s; running the model eagerly (same outputs, uncompiled speed)", reason)

    def warm_up(self, run_forward: Callable[[int, int], Any], device: torch.device) -> None:
        """Compile at start-up: check the compiler, then run the dummy steps of :data:`WARM_UP_STEPS`.

        Args:
            run_forward: ``run_forward(num_tokens, num_reqs)`` runs one dummy step (``num_reqs``
                requests sharing ``num_tokens`` tokens) through :meth:`__call__` inside a forward
                context, choosing the traced-attention path as a real step would (the model runner's).
            device: the model's device (which code generator inductor needs).
        """
        if self._compiled is None:
            return
        try:
            check_compiler(device)
        except Exception as err:  # noqa: BLE001 - any reason the compiler is missing means eager
            self._fall_back(f"compiler unavailable ({type(err).__name__}: {err})")
            return
        self.stats.active = True
        logger.info("engine.compile: compiling the decoder, %d warm-up steps (the first compile of a model takes "
                    "%s; later runs reuse inductor's on-disk cache in %s and take less)",
                    len(WARM_UP_STEPS), FIRST_COMPILE_HINT, _inductor_cache_dir())
        t0 = time.perf_counter()
        for i, (num_tokens, num_reqs) in enumerate(WARM_UP_STEPS, 1):
            run_forward(num_tokens, num_reqs)
            what = f"{num_tokens}-token prefill" if num_reqs == 1 and num_tokens > 1 else f"{num_reqs}-request decode"
            logger.info("engine.compile: [%d/%d] %s step compiled, %.1f s so far", i, len(WARM_UP_STEPS), what,
                        time.perf_counter() - t0)
        self.stats.compile_s = time.perf_counter() - t0
        self.stats.num_graphs_warmup = self.stats.num_graphs
        self._warmed_up = True
        if self.stats.active and self.stats.num_graphs == 0:
            # dynamo ran the frame eagerly without calling the backend (e.g. torch._dynamo's
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
            graph: attention traced into the graph for this step (``None``: the opaque op).

        Returns:
            ``(num_sample_rows, vocab_size)`` logits in the model dtype.
        """
        if self._compiled is not None:
            hidden = self.hidden_states(input_ids, position_ids, graph)
            if hidden is not None:
                return output_logits(self.model, hidden[logits_index])
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          logits_to_keep=logits_index).logits[0]

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      graph: GraphAttention | None = None) -> torch.Tensor | None:
        """The decoder's last hidden states ``(num_tokens, hidden_size)`` (model dtype) from the
        compiled graph (``graph``: as in :meth:`__call__`); ``None`` once compilation has fallen back
        to eager (the caller runs eagerly, through the backend's ``forward``)."""
        if self._compiled is None:
            return None
        torch._dynamo.maybe_mark_dynamic(input_ids, 1)
        torch._dynamo.maybe_mark_dynamic(position_ids, 1)
        extra = {} if graph is None else {"servelab_graph": graph}
        try:
            # duck sizing off: two dynamic dims that happen to be equal in the warm-up (e.g. a traced
            # backend's partition count and the batch size) must not share a symbol, which would
            # recompile at the first step where they differ
            with fx_config.patch(use_duck_shape=False):
                return self._compiled(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                      **extra).last_hidden_state[0]
        except Exception as err:  # noqa: BLE001 - compile errors surface at the call; rerun eagerly
            if self.tensor_parallel and self._warmed_up:
                raise RuntimeError(
                    f"torch.compile failed on a tensor-parallel rank after the warm-up ({type(err).__name__}: "
                    f"{err}); one rank cannot fall back to eager alone (its collectives would no longer line up "
                    "with the other ranks'): restart with engine.compile=false") from err
            # rerunning is safe: a partial forward wrote K/V only at this step's own slots, and
            # the eager forward writes the same values there again (under TP, during the warm-up, a
            # trace-time failure ran no collective; agree_across_ranks then makes every rank eager)
            self._fall_back(f"torch.compile failed ({type(err).__name__}: {err})")
            return None

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
