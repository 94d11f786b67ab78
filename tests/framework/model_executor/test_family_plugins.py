"""Every plugin that touches the model keeps working per family, or refuses clearly: ``engine.compile``,
speculative decoding (draft models and EAGLE heads for non-Llama targets, verify rows through windows
and sinks), structured output, and quant methods (MoE experts left alone and said; GPT-2's Conv1D
refused). Prepacked linears run in every family's ``torch_paged`` parity run (``test_families.py``).
Tiny models and the transformers oracle come from ``tests/families.py``."""

from __future__ import annotations

import logging

import pytest
from families import (
    ENGINE,
    FAMILY_IDS,
    MAX_TOKENS,
    assert_matches_transformers,
    hf_reference,
    prompts,
    run_family,
    tiny_model_dir,
)
from grammar_helpers import SPECS, check_output
from helpers import STORIES_EAGLE

from framework import EngineConfig, SamplingParams, StructuredOutputsParams
from framework.compilation.regions import decoder_layers, layer_fingerprint
from framework.engine.builder import validate_plugins

KERNEL = {"attention": "torch_paged",
          "attention_params": {"compile": False, "min_paged_decodes": 1, "paged_prefill": True}}
#: ``torch_paged`` as the engines below run it: at ``max_num_seqs=4`` no step reaches the in-place kernel's
#: ``min_paged_decodes=8``, so compiling it (inductor's start-up warm-up per layer kind, ~10-30 s of CPU) would
#: only cost time; ``tests/plugins/attention/test_torch_paged.py`` compiles it
EAGER_KERNEL = {"attention_params": {"compile": False}}


def structure(layer) -> tuple:
    """The layer's fingerprint without the ``forward`` the compiled engine set on it (one per layer)."""
    forward = vars(layer).pop("forward", None)
    try:
        return layer_fingerprint(layer)
    finally:
        if forward is not None:
            layer.forward = forward


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_compiled_engine_traces_every_feature(family, make_llm):
    """``engine.compile=true`` (default ``torch_paged``: decode steps attend inside the layer graphs,
    others through the ``servelab::attention`` op with the layer's features as arguments; the LM head
    and Gemma's final softcap after the decoder): dynamo traces each layer kind whole (fullgraph) with
    windows, softcaps, sinks, NoPE layers, MoE and MLA's latent cache, layers of one kind share
    its graphs (the layer index, KV cache and KV cache group's inputs are data), and the engine still equals transformers with
    no recompile, with each step's layers run as one loop of graph calls where the model's loop only chains
    them. ``engine.compile_backend=eager`` runs the traced FX graphs instead of inductor's code, and the opaque
    op's per-layer kernel runs uncompiled too (``attention_params.compile=false``: the traced decode path is the
    same), tens of seconds less per family here; ``tests/framework/compilation/test_decoder.py`` and
    ``tests/plugins/attention/test_torch_paged.py`` cover inductor itself."""
    llm, outs = run_family(make_llm, family, compile=True, compile_backend="eager",
                           attention_params={"min_paged_decodes": 1, "compile": False})
    assert_matches_transformers(family, outs, "compiled")
    summary = llm.engine.metrics.summary()
    assert summary["compile_active"] and summary["compile_num_recompiles"] == 0, summary
    stats = llm.engine.runner.compile_stats
    # prefill, 1-token, traced decode per kind; MLA's latent cache (DeepSeek) attends through the opaque op in
    # every step (torch_paged's in-graph decode keeps K and V apart), so its kinds have no traced-decode graph
    graphs_per_kind = 2 if family.startswith("deepseek") and llm.config.mla_latent_cache else 3
    assert stats.num_graphs_warmup == graphs_per_kind * stats.num_layer_kinds
    # one kind per structural variant of the layer (sliding / full, NoPE, dense / MoE...), not per KV cache
    # group: two groups of sliding layers share their graphs
    model = llm.engine.runner.model
    layers = decoder_layers(model.get_decoder(), model.config.get_text_config().num_hidden_layers)
    assert stats.num_layer_kinds == len({structure(layer) for layer in layers}), family
    # the layers of each step run as one loop of graph calls (layer_stack.py), except Gemma 3's: its loop
    # hands each layer the rotary tables of its type, so the layers do not all get layer 0's arguments
    expected = "per layer: layer 2 gets other keyword arguments" if family == "gemma3" else "stacked"
    assert len(stats.layer_stack) == graphs_per_kind and all(v.startswith(expected) for v in stats.layer_stack.values()), stats.layer_stack


@pytest.mark.parametrize(("family", "drafter"), [("gpt_oss", "draft_model"), ("gemma2", "eagle")])
def test_spec_decode_on_non_llama_targets(family, drafter, make_llm):
    """A draft model of the family itself (every draft accepted: verify rows of k + 1 queries through
    the windows, sinks and MoE of gpt-oss in ``torch_paged``'s kernel) and the stories260K EAGLE head
    on a Gemma 2 target (its hidden size and vocabulary match; Gemma's final softcap applied to the
    target logits the head path computes): greedy output unchanged."""
    model = str(tiny_model_dir(family)) if drafter == "draft_model" else STORIES_EAGLE
    llm, outs = run_family(make_llm, family, **KERNEL, num_blocks=40, drafter=drafter,
                           drafter_params={"model": model, "num_speculative_tokens": 3})
    assert_matches_transformers(family, outs, drafter)
    assert llm.engine.metrics.summary()["spec_num_draft_tokens"] > 0


def test_draft_model_of_a_refused_architecture_is_refused(tmp_path):
    import transformers

    transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              vocab_size=512).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft model .*is_backend_compatible"):
        validate_plugins(EngineConfig(model=str(tiny_model_dir("llama")), drafter="draft_model",
                                      drafter_params={"model": str(tmp_path)}))


def test_structured_output_on_a_family(make_llm):
    """Grammar masks apply to any family's logits (gpt-oss: windows, sinks, MoE): every constrained
    greedy output satisfies its constraint."""
    llm = make_llm(model=str(tiny_model_dir("gpt_oss")), grammar="xgrammar", **EAGER_KERNEL,
                   **{**ENGINE, "max_model_len": 128, "num_blocks": 200})
    kinds = ["choice", "regex"]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(**{k: SPECS[k]}))
              for k in kinds]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(len(kinds))], params)
    for kind, out in zip(kinds, outs):
        assert out.error is None
        if out.outputs[0].finish_reason == "stop":
            check_output(kind, out.outputs[0].text)
    assert outs[0].outputs[0].finish_reason == "stop"  # a choice always closes


@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_weight_quant_leaves_moe_experts_and_says_so(family, make_llm, caplog):
    """int8 weight-only on an MoE family (DeepSeek: MLA projections, a dense first layer, shared experts):
    those linears quantized, the fused 3-D expert tensors and routers kept (logged); greedy output
    still starts like the float model's. The MLA latent cache absorbs ``kv_b_proj`` as a float matrix and is
    refused with weight quantization, so this runs the expanded cache (``engine.mla_latent_cache=false``)."""
    with caplog.at_level(logging.INFO, logger="plugins.quant._common"):
        llm = make_llm(model=str(tiny_model_dir(family)), quant="int8_wo", mla_latent_cache=False, **EAGER_KERNEL,
                       **ENGINE)
    assert any("fused MoE expert tensors" in r.message for r in caplog.records)
    decoder = llm.engine.runner.model.get_decoder()
    assert type(decoder.layers[0].self_attn.o_proj).__name__ == "Int8PackedLinear"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(temperature=0.0, max_tokens=4))
    expected = hf_reference(family, prompts(), MAX_TOKENS)
    assert sum(o.outputs[0].token_ids == tokens[:4] for o, (tokens, _) in zip(outs, expected)) >= 3


def test_weight_quant_refuses_gpt2_before_loading():
    with pytest.raises(ValueError, match="Conv1D"):
        validate_plugins(EngineConfig(model=str(tiny_model_dir("gpt2")), quant="int8_wo"))
