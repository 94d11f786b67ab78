"""``engine.prepack_linears``: CPU linears with weights reordered once into oneDNN's blocked layout.

ATen's bf16/fp16 ``linear`` on CPU re-lays out the weight on every call; for a decode step (a few
rows) that dominates, and bf16 GEMV ran at ~14 GB/s here against ~36 GB/s with the weight
prepacked (``experiments/engine/roofline.py``: linears were 5.5x their bandwidth bound at batch 1). The
same reorder is what inductor's freezing does for compiled CPU graphs (``engine.compile_freezing``)
and what IPEX calls weight prepacking; this applies it to the eager model: every plain
``nn.Linear`` becomes a :class:`PrepackedLinear` calling ``torch.ops.mkldnn._linear_pointwise``.

``auto`` (the default) prepacks every CPU model, float32 included, as vLLM's CPU backend does (its
``dispatch_cpu_unquantized_gemm`` gives float32 linears oneDNN too): served float32 SmolLM2 under ``vllm bench
serve`` went from 0.91x / 0.94x of ``vllm serve`` (16 req/s / saturation) to 0.96x / 1.29x with it, one run each
(docs/results/serving.md), and greedy
outputs still equal transformers' token for token in every parity test (oneDNN's float32 GEMM rounds
differently from ATen's in the last bits; ``engine.prepack_linears=off`` keeps ATen's kernels, the path
transformers itself runs). Quantized linears
(already replaced by a quant method) are untouched. With ``engine.compile`` the prepacked GEMM is
the opaque op ``servelab::prepacked_linear`` (inductor cannot lower ``mkldnn._linear_pointwise`` on
a weight it did not pack), so compiled graphs fuse the elementwise work around prepacked linears,
except in a compiled graph of one row (batch-1 decode, specialised by dynamo): there each linear is
:func:`traced_gemv` on the plain weight, a multiply-and-sum that inductor generates and fuses with its
neighbours (gate/up share one loop). oneDNN's M=1 GEMV streamed the weights at ~17 GB/s here, the
generated loops at ~23 GB/s (read bandwidth ~33 GB/s), and the graph then has no extern call:
SmolLM2 bf16 batch-1 decode step ~23 -> ~16 ms (docs/decisions/cpu_speed.md).

Linears that read the same input are also fused into one GEMM, as vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear`` do: ``gate_proj``/``up_proj`` of every gated MLP
(:class:`FusedGatedMLP`, eager runs only) and ``q_proj``/``k_proj``/``v_proj`` of Llama attention
(``FusedQKVLlamaAttention``). An eager decode step then makes 4 instead of 7 weight-streaming calls
per layer; at batch 1 each call costs ~20 us of oneDNN overhead on top of its bytes.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from framework.platform import cpu_isa

logger = logging.getLogger(__name__)
MODES = ("auto", "on", "off")
LM_HEAD_BATCH_HINT = 64  # rows the LM head's packed layout is tuned for (see PrepackedLinear)
#: Rows a decoder layer's packed layout is tuned for, by weight dtype (default 1: the decode GEMV).
#: float32 takes 64: oneDNN's float32 layout for one row ran a SmolLM2 layer's GEMMs (q/k/v, o,
#: gate, up, down) 1.24x (M=1), 1.59x (M=4), 1.43x (M=16) and 1.15x (M=64) slower than the layout
#: for 64 rows (2-core AMD EPYC, medians of 30 alternating rounds); bfloat16 measured level (M=1 to 64).
LAYER_BATCH_HINT = {torch.float32: 64}
#: transformers MLP classes computing ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
GATED_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP"})


def prepacked_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` prepacked by ``torch.ops.mkldnn._reorder_linear_weight``.

    Registered as the op ``servelab::prepacked_linear``, opaque to ``torch.compile``: inductor cannot
    lower ``mkldnn._linear_pointwise`` on a weight it did not prepack itself, so a compiled graph
    calls this as an extern kernel (the elementwise ops around it still fuse). It is defined with
    ``torch.library.Library`` rather than ``torch.library.custom_op``, whose Python wrapper costs
    ~5 us more per call (151 calls in a SmolLM2 decode step).

    Args:
        x: ``(M, in_features)`` bf16/fp16/fp32 activations.
        packed_weight: the prepacked ``(out_features, in_features)`` weight.
        bias: ``(out_features,)`` or ``None``.
        out_features: output width (for the fake/meta shape).

    Returns:
        ``(M, out_features)`` in ``x.dtype``.
    """
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def traced_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row, as a float32 multiply-and-sum for inductor to generate.

    Under ``torch.compile`` inductor turns it into one loop per output row that streams the row of
    ``weight`` with vector multiply-adds (float32 accumulation, as oneDNN's bf16 GEMM); eagerly it
    materialises the ``(1, out, in)`` product and is slow, so only compiled one-row graphs use it.

    Args:
        x: ``(1, in_features)``.
        weight: ``(out_features, in_features)``, same dtype as ``x``.
        bias: ``(out_features,)`` or ``None``.

    Returns:
        ``(1, out_features)`` in ``x.dtype``.
    """
    out = (x.float()[:, None, :] * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


_LIB = torch.library.Library("servelab", "FRAGMENT")  # noqa: TOR901 - kept alive for the process
_LIB.define("prepacked_linear(Tensor x, Tensor packed_weight, Tensor? bias, SymInt out_features) -> Tensor")
_LIB.impl("prepacked_linear", prepacked_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("servelab::prepacked_linear")
def _(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class PrepackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is also held in oneDNN's blocked layout (CPU).

    The original ``weight`` (and ``bias``) stay registered, so tied embeddings and code that reads
    ``.weight`` see the same Parameter; the packed copy costs one more weight's worth of memory.

    Args:
        linear: the layer to wrap; its weight is ``(out_features, in_features)`` in bf16/fp16/fp32.
        batch_hint: rows oneDNN tunes the packed layout for; ``None``: :data:`LAYER_BATCH_HINT` of the
            weight's dtype (1, the decode GEMV, except float32's 64). The LM head gets 64:
            its ``(64, 576) x (49152, 576)`` bf16 GEMM took 8.1 ms packed for 1 row and 5.5 ms
            packed for 64 here, with the same 1.6 ms at one row.

    Raises:
        RuntimeError: oneDNN cannot reorder the weight (caller falls back to the plain layer).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int | None = None) -> None:
        super().__init__()
        if batch_hint is None:
            batch_hint = LAYER_BATCH_HINT.get(linear.weight.dtype, 1)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    @classmethod
    def fused(cls, linears: list[nn.Linear]) -> PrepackedLinear:
        """One prepacked GEMM computing ``cat([l(x) for l in linears], -1)``.

        The concatenated weight (and bias) is registered on the result next to its packed copy; the
        parts' Parameters go away with their modules. A part without bias contributes zeros when
        another part has one.

        Raises:
            ValueError: the parts read inputs of different widths or differ in dtype.
        """
        if len({(lin.in_features, lin.weight.dtype) for lin in linears}) != 1:
            raise ValueError("fused linears must share in_features and dtype")
        weight = torch.cat([lin.weight.detach() for lin in linears])
        merged = nn.Linear(linears[0].in_features, weight.shape[0], bias=False, device="meta")
        merged.weight = nn.Parameter(weight, requires_grad=False)
        if any(lin.bias is not None for lin in linears):
            merged.bias = nn.Parameter(torch.cat([lin.bias.detach() if lin.bias is not None
                                                  else weight.new_zeros(lin.out_features) for lin in linears]),
                                       requires_grad=False)
        return cls(merged)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features) -> (..., out_features)``, same dtype as ``x``."""
        bias = None if self.bias is None else self.bias.detach()
        rows = x.reshape(-1, self.in_features)
        # a dynamic row count is >= 2 by dynamo's 0/1 specialisation: no guard is added here
        if torch.compiler.is_compiling() and rows.shape[0] == 1:
            out = traced_gemv(rows, self.weight.detach(), bias)
        else:
            out = torch.ops.servelab.prepacked_linear(rows, self._packed, bias, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)


def onednn_has_kernels(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack and run ``dtype`` GEMMs on this CPU, as oneDNN itself decides (after
    ``ONEDNN_MAX_CPU_ISA``): bf16 needs avx512bw/vl/dq or avx_ne_convert, fp16 avx512_fp16, amx_fp16 or
    avx_ne_convert; float32 runs everywhere. On an AVX2-only CPU (AMD Zen 3) ``_reorder_linear_weight``
    raises for bf16 ("bf16 path needs the cpu support avx_ne_convert or avx512bw ...")."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def should_prepack(mode: str, device: torch.device, dtype: torch.dtype, compile_freezing: bool = False) -> bool:
    """Whether ``engine.prepack_linears=<mode>`` applies to this model.

    ``auto``: CPU (any float dtype oneDNN has kernels for here: :func:`onednn_has_kernels`) and not
    ``engine.compile_freezing`` (inductor's freezing packs the weights itself). Eager and compiled runs alike.
    A dtype oneDNN cannot run on this CPU keeps ATen's linears, logged with the reason (a warning for ``on``).

    Raises:
        ValueError: unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"prepack_linears must be one of {MODES}, got {mode!r}")
    if mode == "off" or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype.is_floating_point and not onednn_has_kernels(dtype):

        (logger.warning if mode == "on" else logger.info)(
            "prepack_linears=%s: %s GEMMs keep ATen's kernels: oneDNN has no %s path on %s",
            mode, dtype, dtype, cpu_isa().summary())
        return False
    return mode == "on" or (dtype.is_floating_point and not compile_freezing)


def prepack_linears(model: nn.Module, compiled: bool = False, fuse: bool = True) -> int:
    """Fuse linears that share an input, then replace every remaining plain ``nn.Linear`` of
    ``model`` (CPU) by a :class:`PrepackedLinear` (see the module docstring).

    Args:
        model: the transformers model, modified in place.
        compiled: the model will run under ``engine.compile``: gate/up stay separate GEMMs there
            (measured: with both q/k/v and gate/up fused, the compiled batch-1 step took 43 instead
            of 26 ms, time spent in oneDNN's thread barriers; q/k/v alone is the fastest compiled
            variant; eager gains from both).
        fuse: fuse q/k/v and gate/up first; ``False`` prepacks every linear as it is (multi-LoRA under tensor
            parallelism, whose sharded parts LoRA wraps one by one).

    Returns:
        The number of prepacked GEMMs installed (0 when oneDNN refuses; a warning says why, and
        the layers replaced before the refusal stay replaced: they compute the same).
    """
    try:
        fused = _fuse_projections(model, fuse_mlp=not compiled) if fuse else 0
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        # a tensor-parallel LM head (framework/model_executor/parallel_layers.py) is the parent of its shard
        packed = [(parent, name, PrepackedLinear(child, batch_hint=LM_HEAD_BATCH_HINT if head in (child, parent) else None))
                  for parent in model.modules() for name, child in parent.named_children()
                  if type(child) is nn.Linear]
    except RuntimeError as err:
        logger.warning("prepack_linears: oneDNN cannot prepack (%s); keeping ATen linears", err)
        return 0
    for parent, name, layer in packed:
        setattr(parent, name, layer)
    return fused + len(packed)


def unfuse_gated_mlps(model: nn.Module) -> int:
    """Split every :class:`FusedGatedMLP` of ``model`` back into separate ``gate_proj``/``up_proj``
    prepacked GEMMs, the layout compiled graphs run fastest (see :func:`prepack_linears`' ``compiled``).
    Used when an eagerly prepacked model is compiled later (``engine.compile=auto``).

    Returns:
        The number of MLPs split (0 when none was fused).
    """
    count = 0
    for module in model.modules():
        if isinstance(module, FusedGatedMLP) and type(module.gate_up_proj) is PrepackedLinear:  # LoRA-wrapped: kept
            module.unfuse()
            count += 1
    return count


class FusedGatedMLP(nn.Module):
    """A gated MLP (``down(act(gate(x)) * up(x))``: Llama, Mistral, Qwen2...) with ``gate``/``up`` as one GEMM.

    Args:
        mlp: a module with plain ``nn.Linear`` ``gate_proj``, ``up_proj`` and an ``act_fn``; its
            weights are taken over. A plain ``down_proj`` is prepacked here; any other (a
            tensor-parallel ``RowParallelLinear``) is kept, and ``prepack_linears`` packs its inner linear.
    """

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.intermediate_size = mlp.gate_proj.out_features
        self.gate_up_proj: PrepackedLinear | None = PrepackedLinear.fused([mlp.gate_proj, mlp.up_proj])
        self.gate_proj: PrepackedLinear | None = None  # set by unfuse()
        self.up_proj: PrepackedLinear | None = None
        self.down_proj = PrepackedLinear(mlp.down_proj) if type(mlp.down_proj) is nn.Linear else mlp.down_proj
        self.act_fn = mlp.act_fn

    def unfuse(self) -> None:
        """Replace the fused GEMM by separate ``gate_proj``/``up_proj`` ones (same weights, split)."""
        fused, size = self.gate_up_proj, self.intermediate_size
        parts = []
        for rows in (slice(0, size), slice(size, None)):
            part = nn.Linear(fused.in_features, size, bias=fused.bias is not None, device="meta")
            part.weight = nn.Parameter(fused.weight.detach()[rows].clone(), requires_grad=False)
            if fused.bias is not None:
                part.bias = nn.Parameter(fused.bias.detach()[rows].clone(), requires_grad=False)
            parts.append(PrepackedLinear(part))
        self.gate_proj, self.up_proj = parts
        self.gate_up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., hidden) -> (..., hidden)``, same dtype."""
        if self.gate_up_proj is None:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


@functools.cache
def _fused_qkv_llama_class() -> type[nn.Module]:
    """``FusedQKVLlamaAttention`` (defined lazily: transformers is imported only when fusing)."""
    from transformers.models.llama import modeling_llama as llama

    class FusedQKVLlamaAttention(llama.LlamaAttention):
        """``LlamaAttention`` with ``q_proj``/``k_proj``/``v_proj`` as one prepacked GEMM ``qkv_proj``.

        Same computation as transformers' ``LlamaAttention.forward`` (RoPE, then the configured
        attention interface, then ``o_proj``); installed by :func:`prepack_linears` by swapping the
        class of an existing module whose type is exactly ``LlamaAttention``.
        """

        qkv_proj: PrepackedLinear

        def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            """``hidden_states (batch, seq, hidden)`` -> ``((batch, seq, hidden), attn_weights or None)``."""
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
            q = q.view(hidden_shape).transpose(1, 2)
            k = k.view(hidden_shape).transpose(1, 2)
            v = v.view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, self.layer_idx)
            interface = llama.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    llama.eager_attention_forward)
            out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
            return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return FusedQKVLlamaAttention


def _fuse_projections(model: nn.Module, fuse_mlp: bool = True) -> int:
    """Fuse gate/up of gated MLPs (if ``fuse_mlp``) and q/k/v of Llama attention (plain ``nn.Linear`` parts only).

    Returns:
        The number of prepacked GEMMs installed (2 per MLP, 1 when its ``down_proj`` is not a plain
        ``nn.Linear``; 1 per attention).
    """
    fused = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (fuse_mlp and type(child).__name__ in GATED_MLP_CLASSES and hasattr(child, "down_proj")
                    and all(type(getattr(child, p, None)) is nn.Linear for p in ("gate_proj", "up_proj"))):
                fused += 1 + (type(child.down_proj) is nn.Linear)  # gate_up_proj, and down_proj if packed here
                setattr(parent, name, FusedGatedMLP(child))
    try:
        from transformers.models.llama.modeling_llama import LlamaAttention
    except ImportError:  # pragma: no cover - transformers always ships Llama
        return fused
    for module in model.modules():
        if type(module) is LlamaAttention and all(type(getattr(module, p)) is nn.Linear
                                                  for p in ("q_proj", "k_proj", "v_proj")):
            projs = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_proj = PrepackedLinear.fused(projs)
            module.qkv_sizes = [p.out_features for p in projs]
            del module.q_proj, module.k_proj, module.v_proj
            module.__class__ = _fused_qkv_llama_class()
            fused += 1
    return fused
