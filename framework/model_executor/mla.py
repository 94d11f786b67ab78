"""Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache: the weight absorption of DeepSeek-V2
§2.1.2-2.1.3, as FlashMLA and vLLM's MLA "absorb" path compute it.

Per token and layer the paged cache holds ``[c_kv, k_rope]``: the compressed KV latent after
``kv_a_layernorm`` (``kv_lora_rank`` numbers) and the shared rotary key after RoPE
(``qk_rope_head_dim``), one "KV head" of ``kv_lora_rank + qk_rope_head_dim`` channels (576 for DeepSeek-V3,
against ``num_heads * (qk_head_dim + v_head_dim)`` = 40,960 expanded). ``kv_b_proj`` holds, per head ``h``,
``W_UK[h]`` (``qk_nope_head_dim x kv_lora_rank``) and ``W_UV[h]`` (``v_head_dim x kv_lora_rank``). Since
``q_nope[h] . (W_UK[h] c) = (q_nope[h] W_UK[h]) . c``, attention runs in latent space:

- query ``[q_nope[h] W_UK[h], q_rope[h]]`` (``kv_lora_rank + qk_rope_head_dim`` per head), one KV head
  (MQA) ``[c_kv, k_rope]``, value ``c_kv``; softmax scale unchanged (the module's ``scaling``);
- output per head ``o_latent[h] W_UV[h]^T`` (``v_head_dim``), then ``o_proj`` as before.

Rule: every token absorbs, prefill chunks and decodes alike (one code path; vLLM expands the latent for
long prefills, where ``num_heads`` x larger per-head K/V GEMMs beat the latent's wider dot products: a
speed choice this CPU reference does not make).

The models stay transformers' classes: :func:`use_latent_attention` replaces each attention module's
``expand_kv`` (called right after RoPE, on the latents, just before the attention function) with one that
hands the latents on unexpanded, and marks the module; the bridge
(``framework/model_executor/forward_context.py``) then calls :func:`absorb_query` before the backend and
:func:`project_output` after it.

Tensor parallelism (vLLM's DeepseekV2MLAAttention): a rank holds ``num_heads / tp`` query heads, i.e. their
rows of ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` and their columns of ``o_proj``
(``framework/model_executor/tensor_parallel.py``), so ``W_UK``/``W_UV`` here are its heads' slices; the latent
comes from the replicated ``kv_a_proj_with_mqa`` and is cached whole on every rank (one head of
``kv_lora_rank + qk_rope_head_dim`` channels, not split: every head reads all of it).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch

from framework.interfaces import AttentionLayerSpec

#: Attribute set on an attention module whose calls carry the latent (the bridge absorbs around them).
MARK = "servelab_mla_latent"


def use_latent_attention(model: torch.nn.Module, layers: Sequence[AttentionLayerSpec]) -> int:
    """Route ``model``'s MLA attention modules through the latent cache when ``layers`` say so (``latent_kv``).

    Each module with ``kv_b_proj`` and ``expand_kv`` (transformers' ``DeepseekV2Attention``/``V3Attention``)
    gets an instance-level ``expand_kv`` returning ``key = [c_kv, k_rope]`` ``(B, 1, S, kv_lora_rank +
    qk_rope_head_dim)`` and ``value = c_kv`` ``(B, 1, S, kv_lora_rank)``, and :data:`MARK` set to its
    ``(W_UK, W_UV)``: ``(num_heads, qk_nope_head_dim, kv_lora_rank)`` and ``(num_heads, v_head_dim,
    kv_lora_rank)`` views of ``kv_b_proj.weight`` (model dtype; no copy). Under tensor parallelism ``num_heads``
    is the rank's (the sharded module's, set by ``tensor_parallel.shard_model``).

    Returns:
        The number of modules changed (0 when no layer is latent).

    Raises:
        ValueError: latent layers but a different number of MLA modules, or a ``kv_b_proj`` without a
            floating-point ``(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)`` weight (a
            quantized one): set ``engine.mla_latent_cache=false``.
    """
    if not any(layer.latent_kv for layer in layers):
        return 0
    modules = [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "expand_kv")]
    if len(modules) != len(layers):
        raise ValueError(f"the MLA latent cache expects {len(layers)} MLA attention modules (kv_b_proj, expand_kv), "
                         f"found {len(modules)}; set engine.mla_latent_cache=false")
    for module in modules:
        weight = getattr(module.kv_b_proj, "weight", None)
        heads, nope, v_dim, rank = module.num_heads, module.qk_nope_head_dim, module.v_head_dim, module.kv_lora_rank
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or \
                tuple(weight.shape) != (heads * (nope + v_dim), rank):
            raise ValueError(f"layer {module.layer_idx}: kv_b_proj has no float ({heads * (nope + v_dim)}, {rank}) "
                             "weight to absorb; set engine.mla_latent_cache=false")
        per_head = weight.view(heads, nope + v_dim, rank)
        setattr(module, MARK, (per_head[:, :nope], per_head[:, nope:]))
        module.expand_kv = types.MethodType(_latent_kv, module)
    return len(modules)


def _latent_kv(module: torch.nn.Module, kv_nope: torch.Tensor,
               k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``expand_kv`` of a latent module: ``(key [c_kv, k_rope], value c_kv)``, both one head, unexpanded."""
    return torch.cat((kv_nope, k_rot.to(kv_nope.dtype)), dim=-1), kv_nope


def absorb_query(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """The query of one latent call in latent space (DeepSeek-V2 eq. 10 with ``W_UK`` absorbed).

    Args:
        module: an attention module :func:`use_latent_attention` marked.
        query: ``(1, num_heads, num_tokens, qk_nope_head_dim + qk_rope_head_dim)``, post-RoPE, model dtype.

    Returns:
        ``(1, num_heads, num_tokens, kv_lora_rank + qk_rope_head_dim)``: ``[q_nope W_UK, q_rope]`` per head.
    """
    w_uk, _ = getattr(module, MARK)
    q_nope, q_rope = query.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk.to(query.dtype))
    return torch.cat((q_latent, q_rope), dim=-1)


def project_output(module: torch.nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Per-head values from one latent call's output (``W_UV`` applied after attention, eq. 11 absorbed).

    Args:
        out: ``(1, num_tokens, num_heads, kv_lora_rank)``, the attention-weighted latents.

    Returns:
        ``(1, num_tokens, num_heads, v_head_dim)``, what transformers' ``o_proj`` expects (after its reshape).
    """
    _, w_uv = getattr(module, MARK)
    return torch.einsum("bthr,hvr->bthv", out, w_uv.to(out.dtype))
