"""Which decoder architectures servelab runs, and what each layer's attention needs, from ``config.json``.

:func:`attention_layers` turns a transformers config into one
:class:`~framework.interfaces.AttentionLayerSpec` per decoder layer (head counts and sizes, sliding
window, softcap, sinks), or refuses the model with :class:`UnsupportedModelError` — both before any
weights load. It mirrors what transformers 5's modeling files pass their attention function:

- sliding window: configs with ``layer_types`` window exactly their ``"sliding_attention"`` layers
  (Gemma 2/3, gpt-oss, Qwen2/3 with ``use_sliding_window``, SmolLM3, Ministral); Mistral, Mixtral,
  Phi-3, Qwen3-MoE (no ``layer_types``) apply one ``config.sliding_window`` to every layer;
- attention-logit softcap: ``attn_logit_softcapping`` of Gemma 2 (Gemma 3 keeps the field but
  does not pass it);
- sinks: gpt-oss (``s_aux``, one learned logit per head);
- MLA (DeepSeek-V2/V3): with ``mla_latent_cache`` (``engine.mla_latent_cache``, default on) one latent
  "KV head" per token, ``head_size = kv_lora_rank + qk_rope_head_dim``, ``value_head_size = kv_lora_rank``,
  ``latent_kv`` (framework/model_executor/mla.py absorbs the up-projections); without it K/V expanded
  per head, ``head_size = qk_nope_head_dim + qk_rope_head_dim`` and ``value_head_size = v_head_dim``.

The bridge (``framework/model_executor/forward_context.py``) checks every call against these specs, so a
rule that falls out of date with transformers fails loudly instead of computing something else.
:data:`FAMILIES` is the table ``servelab models`` and the README print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.interfaces import AttentionLayerSpec

#: Layer types transformers' configs use for attention layers this engine runs.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
#: Model types without ``layer_types`` whose every layer gets ``config.sliding_window``.
GLOBAL_WINDOW_MODEL_TYPES = frozenset({"mistral", "mixtral", "phi3", "qwen3_moe", "qwen2_moe", "starcoder2"})
#: Model types whose attention modules pass ``softcap=config.attn_logit_softcapping``.
SOFTCAP_MODEL_TYPES = frozenset({"gemma2", "vaultgemma"})
#: Model types whose attention modules pass ``s_aux`` (learned sinks) on every layer.
SINK_MODEL_TYPES = frozenset({"gpt_oss"})


#: ``ModelFamily.tp`` of a family whose tiny model's greedy output at ``tensor_parallel_size=2`` equals
#: transformers' (``tests/framework/model_executor/test_tensor_parallel_families.py``).
TP_VERIFIED = "verified"


class UnsupportedModelError(ValueError):
    """A model servelab refuses before its weights load; the message says why and what to use instead."""


@dataclass(frozen=True)
class ModelFamily:
    """One row of the supported-architecture table (``servelab models``, README)."""

    name: str  # family, as researchers call it
    architecture: str  # transformers ``*ForCausalLM`` class
    model_types: tuple[str, ...]  # ``config.model_type`` values it covers
    features: tuple[str, ...]  # attention features its checkpoints use (keys of interfaces.attention.CAPABILITY_OF)
    traits: tuple[str, ...]  # what else is particular to it (MoE, biases, norms, positions...)
    examples: str  # checkpoints of the family
    test_id: str  # pytest id of its tiny random-weight model in tests/framework/model_executor/test_families.py
    # tensor parallelism: TP_VERIFIED, or why it is refused (framework/model_executor/tensor_parallel.py)
    tp: str = "not checked under tensor parallelism"

    @property
    def test(self) -> str:
        """The parity test of its tiny random-weight model (a pytest node id)."""
        return f"tests/framework/model_executor/test_families.py::test_family_parity[{self.test_id}]"


_W, _S, _K = "sliding_window", "softcap", "has_sinks"
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("Llama", "LlamaForCausalLM", ("llama",), (), (), "Llama-3.2-1B, SmolLM2-135M", "llama", tp=TP_VERIFIED),
    ModelFamily("SmolLM3", "SmolLM3ForCausalLM", ("smollm3",), (_W,), ("NoPE layers",), "SmolLM3-3B", "smollm3", tp=TP_VERIFIED),
    ModelFamily("Qwen2 / Qwen2.5", "Qwen2ForCausalLM", ("qwen2",), (_W,), ("q/k/v bias",), "Qwen2.5-0.5B", "qwen2", tp=TP_VERIFIED),
    ModelFamily("Qwen3", "Qwen3ForCausalLM", ("qwen3",), (), ("q/k norm", "head_dim != hidden/heads"),
                "Qwen3-0.6B", "qwen3", tp=TP_VERIFIED),
    ModelFamily("Qwen3-MoE", "Qwen3MoeForCausalLM", ("qwen3_moe",), (_W,), ("MoE", "q/k norm"), "Qwen3-30B-A3B",
                "qwen3_moe", tp=TP_VERIFIED),
    ModelFamily("Mistral", "MistralForCausalLM", ("mistral",), (_W,), ("window on every layer",), "Mistral-7B-v0.1",
                "mistral", tp=TP_VERIFIED),
    ModelFamily("Ministral", "MinistralForCausalLM", ("ministral",), (_W,), ("window per layer_types",),
                "Ministral-8B-Instruct-2410", "ministral", tp=TP_VERIFIED),
    ModelFamily("Mixtral", "MixtralForCausalLM", ("mixtral",), (_W,), ("MoE",), "Mixtral-8x7B", "mixtral", tp=TP_VERIFIED),
    ModelFamily("Gemma 2", "Gemma2ForCausalLM", ("gemma2",), (_W, _S),
                ("final-logit softcap", "query_pre_attn_scalar", "embedding scaling"), "gemma-2-2b", "gemma2", tp=TP_VERIFIED),
    ModelFamily("Gemma 3 (text)", "Gemma3ForCausalLM", ("gemma3_text",), (_W,),
                ("5:1 local/global layers", "per-type RoPE", "q/k norm"), "gemma-3-270m, gemma-3-1b", "gemma3", tp=TP_VERIFIED),
    ModelFamily("Phi-3 / Phi-4-mini", "Phi3ForCausalLM", ("phi3",), (_W,), ("fused qkv", "fused gate/up"),
                "Phi-3-mini-4k, Phi-4-mini", "phi3", tp=TP_VERIFIED),
    ModelFamily("OLMo 2", "Olmo2ForCausalLM", ("olmo2",), (), ("q/k norm", "post-norm"), "OLMo-2-0425-1B", "olmo2", tp=TP_VERIFIED),
    ModelFamily("OLMoE", "OlmoeForCausalLM", ("olmoe",), (), ("MoE", "clip_qkv"), "OLMoE-1B-7B", "olmoe", tp=TP_VERIFIED),
    ModelFamily("gpt-oss", "GptOssForCausalLM", ("gpt_oss",), (_W, _K), ("MoE", "biases"), "gpt-oss-20b", "gpt_oss",
                tp="transformers' plan shards only its embedding: the biased experts and the per-head attention "
                   "sinks (s_aux) have no tensor-parallel plan"),
    ModelFamily("GPT-2", "GPT2LMHeadModel", ("gpt2",), (), ("absolute positions", "Conv1D", "per-layer scaling"),
                "gpt2, distilgpt2", "gpt2",
                tp="no tensor-parallel plan (base_model_tp_plan), and its Conv1D projections are not nn.Linear"),
    ModelFamily("GPT-NeoX / Pythia", "GPTNeoXForCausalLM", ("gpt_neox",), (), ("partial rotary", "parallel residual"),
                "pythia-160m", "gpt_neox", tp=TP_VERIFIED),
    ModelFamily("DeepSeek-V2 / V3 (MLA)", "DeepseekV3ForCausalLM", ("deepseek_v2", "deepseek_v3"), ("latent_kv",),
                ("absorbed up-projections", "MoE"), "DeepSeek-V2-Lite, DeepSeek-V3",
                "deepseek_v3", tp=TP_VERIFIED),
)


def family_of(model_type: str) -> ModelFamily | None:
    """The :data:`FAMILIES` row covering ``model_type``, or ``None`` (an architecture no test covers)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def causal_lm_class(config: Any) -> type:
    """The transformers class ``AutoModelForCausalLM`` would build for ``config`` (imports it, no weights).

    Raises:
        UnsupportedModelError: no causal-LM class (encoder-only or encoder-decoder models...).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedModelError(f"model_type {config.model_type!r} has no causal-LM class in transformers "
                                    "(servelab serves decoder-only language models)") from None


def refusal(config: Any) -> str | None:
    """Why servelab cannot run ``config`` exactly, or ``None``: encoder-decoder and non-causal models,
    multimodal wrappers, classes whose attention bypasses transformers' attention interface (Falcon,
    Bloom, MPT, state-space models) and GPT-2 cross-attention."""
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model; servelab serves decoder-only language models"
    if getattr(config, "use_bidirectional_attention", False):
        return f"{model_type} uses bidirectional (non-causal) attention (use_bidirectional_attention=true)"
    if getattr(config, "add_cross_attention", False):
        return f"{model_type} has cross-attention layers (add_cross_attention=true)"
    if getattr(config, "num_hidden_layers", None) is None and hasattr(config, "get_text_config"):
        return (f"{model_type} is a multimodal wrapper; load its text-only decoder checkpoint "
                "(e.g. Gemma3ForCausalLM, model_type gemma3_text)")
    try:
        cls = causal_lm_class(config)
    except UnsupportedModelError as err:
        return str(err)
    if not cls.is_backend_compatible():
        return (f"{cls.__name__}'s attention does not go through transformers' attention interface "
                "(is_backend_compatible() is False), so servelab's paged attention cannot replace it")
    layer_types = getattr(config, "layer_types", None) or ()
    unknown = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if unknown:
        return (f"{model_type} has layer types {unknown}; servelab runs only {list(ATTENTION_LAYER_TYPES)} "
                "(no chunked, linear or state-space layers)")
    return None


def _windows(config: Any, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (tokens), as the model's attention modules pass it."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    # no layer_types: Mistral, Mixtral, Phi-3, Qwen3-MoE window every layer; an unknown family is
    # assumed to do the same (the bridge checks the first call of every layer)
    return [int(window)] * num_layers


def attention_layers(config: Any, mla_latent_cache: bool = False) -> list[AttentionLayerSpec]:
    """One :class:`AttentionLayerSpec` per decoder layer of ``config`` (a transformers config).

    ``mla_latent_cache`` (the engine passes ``engine.mla_latent_cache``) makes an MLA model's layers cache
    the latent (``latent_kv``); other models ignore it.

    Raises:
        UnsupportedModelError: :func:`refusal` names a reason, or ``layer_types`` has the wrong length.
    """
    reason = refusal(config)
    if reason is not None:
        raise UnsupportedModelError(f"servelab cannot run this model: {reason}")
    num_layers, num_heads = config.num_hidden_layers, config.num_attention_heads
    latent = False
    if is_mla(config) and mla_latent_cache:  # one KV "head": [c_kv, k_rope], V = c_kv
        head_size = config.kv_lora_rank + config.qk_rope_head_dim
        value_head_size, num_kv_heads, latent = config.kv_lora_rank, 1, True
    elif is_mla(config):  # K/V expanded per head
        head_size = config.qk_nope_head_dim + config.qk_rope_head_dim
        value_head_size, num_kv_heads = config.v_head_dim, num_heads
    else:
        head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        value_head_size = head_size
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads  # GPT-2/NeoX: no GQA
    windows = _windows(config, num_layers)
    if len(windows) != num_layers:
        raise UnsupportedModelError(f"config.layer_types has {len(windows)} entries for {num_layers} layers")
    softcap = getattr(config, "attn_logit_softcapping", None) if config.model_type in SOFTCAP_MODEL_TYPES else None
    sinks = config.model_type in SINK_MODEL_TYPES
    return [AttentionLayerSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                               value_head_size=value_head_size, sliding_window=window,
                               softcap=float(softcap) if softcap else None, has_sinks=sinks, latent_kv=latent)
            for window in windows]


def is_mla(config: Any) -> bool:
    """``config`` describes multi-head latent attention (DeepSeek-V2/V3: ``qk_nope_head_dim``, ``v_head_dim``)."""
    return bool(getattr(config, "qk_nope_head_dim", None) and getattr(config, "v_head_dim", None))


def output_logits(model: Any, hidden_states: Any) -> Any:
    """The logits ``model``'s ``*ForCausalLM`` wrapper computes from decoder hidden states: its output
    embedding, then what the wrapper applies after it — Gemma 2/3's final-logit softcap
    (``c * tanh(logits / c)``), Cohere's ``logit_scale``, Granite's ``logits_scaling``.

    For paths that call the decoder and the LM head separately (``engine.compile``, EAGLE's hidden
    states), so they give the wrapper's logits.

    Args:
        hidden_states: ``(rows, hidden_size)`` after the decoder's final norm, model dtype.

    Returns:
        ``(rows, vocab_size)`` logits in the model dtype.
    """
    import torch

    logits = model.get_output_embeddings()(hidden_states)
    config = model.config
    scale = getattr(model, "logit_scale", None)
    if isinstance(scale, (int, float)) and scale != 1:
        logits = logits * scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits
