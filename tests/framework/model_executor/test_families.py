"""Every model family servelab runs (``framework/model_executor/model_families.py``) equals transformers.

Per family, a tiny random-weight model (``tests/families.py``: windows smaller than the context and
not a multiple of the block size, mixed layer types, softcaps that bend the scores, sinks, MoE,
MLA's value head size) runs one engine per backend with chunked prefill (16-token budget), prefix
caching (prompts share 12 tokens, 4-token blocks) and preemption (30 blocks for 4 requests of up to 53
tokens) forced: greedy tokens equal transformers' eager ``generate`` token for token and each step's
log-probabilities are within 1e-4. ``torch`` runs the reference (SDPA, explicit math for softcap
and sinks); ``torch_paged`` runs its in-place kernel for every token (decodes, chunks with cached
context, prefix hits) with prepacked oneDNN linears. Negative controls show the comparison catches a
backend that drops the window, the softcap or the sinks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from families import (
    COMMON_TINY,
    ENGINE,
    FAMILY_IDS,
    MAX_TOKENS,
    assert_matches_transformers,
    hf_reference,
    prompts,
    run_family,
    tiny_config,
    tiny_model_dir,
)

from framework import EngineConfig, SamplingParams
from framework.engine.builder import inspect_model
from framework.interfaces import AttentionLayerSpec
from framework.model_executor.forward_context import call_features
from framework.model_executor.model_families import FAMILIES, attention_layers
from plugins.attention.torch import TorchAttentionBackend

BACKENDS = {
    "torch": dict(attention="torch"),
    "torch_paged": dict(attention="torch_paged", prepack_linears="on",
                        attention_params={"compile": False, "min_paged_decodes": 1, "paged_prefill": True}),
}


def test_every_family_has_a_tiny_model_and_a_row():
    """The table ``servelab models`` prints and the tiny models cover the same families, and each tiny
    model's ``model_type`` is its row's."""
    assert sorted(f.test_id for f in FAMILIES) == sorted(FAMILY_IDS)
    for family in FAMILIES:
        assert tiny_config(family.test_id).model_type in family.model_types


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_family_parity(family, make_llm):
    for backend, overrides in BACKENDS.items():
        llm, outs = run_family(make_llm, family, **overrides)
        assert_matches_transformers(family, outs, backend)
        summary = llm.engine.metrics.summary()
        assert summary["num_preemptions"] > 0 and llm.engine.kv_allocator.stats().hit_rate > 0.2, summary
        assert summary["num_steps"] > MAX_TOKENS + 2  # prompts were chunked


#: Expected sliding window of each layer, as transformers' modules pass it (None: full attention).
WINDOWS = {"smollm3": [None, 7, None], "qwen2": [None, 7, 7], "qwen3_moe": [7, 7, 7], "mistral": [7, 7, 7],
           "ministral": [7, None, 7], "mixtral": [7, 7, 7], "gemma2": [7, None, 7], "gemma3": [7, 7, None],
           "phi3": [7, 7, 7], "gpt_oss": [7, None, 7]}


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_attention_layers_read_from_config(family):
    """Windows per layer (layer_types, or one global window), softcap, sinks and head shapes, before
    any weights exist (config only)."""
    layers = attention_layers(tiny_config(family))
    assert [layer.sliding_window for layer in layers] == WINDOWS.get(family, [None] * 3)
    assert {layer.softcap for layer in layers} == ({1.0} if family == "gemma2" else {None})
    assert {layer.has_sinks for layer in layers} == {family == "gpt_oss"}
    heads = {(layer.num_heads, layer.num_kv_heads, layer.head_size, layer.value_head_size) for layer in layers}
    expected = {"qwen3": (4, 2, 24, 24), "gpt2": (4, 4, 16, 16), "gpt_neox": (4, 4, 16, 16),
                "deepseek_v3": (4, 4, 24, 12)}.get(family, (4, 2, 16, 16))
    assert heads == {expected}


@pytest.mark.parametrize(("family", "feature"), [("mistral", "sliding_window"), ("gemma2", "softcap"),
                                                  ("gpt_oss", "sinks")])
def test_negative_control_backend_without_the_feature_diverges(family, feature, make_llm):
    """The parity check is sensitive to each feature: a backend that drops it (here: the call's keyword
    is removed before ``torch``'s forward sees it) no longer matches transformers. It runs on the
    reference backend with an allocator that keeps every block (``radix``: no KV cache groups, nothing
    released), so a dropped window is caught by the mask semantics alone, not by reads of released
    blocks; the same engine with the feature kept matches (the positive control)."""
    def generate(llm):
        return [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts()],
                                                                 SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]

    expected = [tokens for tokens, _ in hf_reference(family, prompts(), MAX_TOKENS)]
    engine = {**ENGINE, "attention": "torch", "kv_allocator": "radix"}
    kept = make_llm(model=str(tiny_model_dir(family)), **engine)
    assert len(kept.engine.runner.kv_cache_layout.groups) == 1  # one full table per request: no block released
    assert generate(kept) == expected
    llm = make_llm(model=str(tiny_model_dir(family)), **engine)
    backend = llm.engine.runner.backend
    forward = backend.forward
    backend.forward = lambda *args, **features: forward(*args, **{k: v for k, v in features.items() if k != feature})
    assert generate(llm) != expected, f"dropping {feature} went unnoticed"


def _save_config(tmp_path: Path, config) -> str:
    """A model folder holding only ``config.json`` (no weights: a refusal must come before loading them)."""
    config.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(("make_config", "message"), [
    (lambda t: t.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=512),
     "is_backend_compatible"),
    (lambda t: t.Gemma3TextConfig(**{**COMMON_TINY, "head_dim": 16}, use_bidirectional_attention=True), "non-causal"),
    (lambda t: t.Qwen3Config(**COMMON_TINY, layer_types=["full_attention", "chunked_attention", "full_attention"]),
     "layer types"),
    (lambda t: t.T5Config(d_model=64, num_layers=2, num_heads=4, vocab_size=512), "encoder-decoder"),
    (lambda t: t.Gemma3Config(text_config={**COMMON_TINY, "head_dim": 16}), "multimodal"),
], ids=["falcon", "non_causal", "unknown_layer_type", "encoder_decoder", "multimodal"])
def test_refused_before_weights_load(tmp_path, make_config, message):
    import transformers

    folder = _save_config(tmp_path, make_config(transformers))
    with pytest.raises(ValueError, match=message):
        inspect_model(EngineConfig(model=folder))


def test_backend_without_softcap_is_refused_for_gemma2_naming_backends_that_can():
    with pytest.raises(ValueError, match="has no attention-logit softcapping") as err:
        inspect_model(EngineConfig(model=str(tiny_model_dir("gemma2")), attention="xformers"))
    capable = str(err.value).rsplit("backends that can run this model: ", 1)[1]
    assert {"torch", "torch_paged", "flash_attn (CUDA)"} <= set(capable.split(", "))
    assert "xformers" not in capable and "flashinfer" not in capable  # no softcap / no head size 16


def test_a_call_the_spec_did_not_foresee_raises():
    """The bridge checks each call against the layer's spec: a window the config did not describe (a
    family rule out of date) is an error, not silently different attention."""
    import torch

    layers = [AttentionLayerSpec(4, 2, 8, 8)]
    backend = TorchAttentionBackend(4, 2, 8, 8 ** -0.5, 4, torch.float32, torch.device("cpu"), layers=layers)
    q, k = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="sliding_window=5"):
        call_features(backend, 0, q, k, None, 5, None, None)
    with pytest.raises(RuntimeError, match="num_kv_heads=4"):
        call_features(backend, 0, q, torch.zeros(1, 4, 3, 8), None, None, None, None)
    assert call_features(backend, 0, q, k, 0.5, None, None, None) == {"scale": 0.5}

