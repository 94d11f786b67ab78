"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) load as they are.

Each checkpoint is written by ``scripts/quantize_checkpoint.py`` (our round-to-nearest quantizer in the
formats' own packing) from stories260K; the quantizer also returns its dequantized weights, and transformers
running those weights is the oracle. ``kernel=reference`` must equal it token for token (float32 greedy);
the fast CPU path (int4/int8 kernels, repacked at load) must pick the oracle's argmax up to near ties
(:data:`FAST_REL_TOL`); W8A8/FP8 checkpoints, whose inputs are quantized too, within
:data:`INPUT_QUANT_REL_TOL`. Bad checkpoints: ``test_checkpoint_errors.py``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from helpers import REPO, STORIES

from framework import registry
from framework.core.sampling_params import SamplingParams
from framework.model_executor.model_loader import load_model
from plugins.quant._checkpoint_linears import Int4CheckpointLinear, Int8CheckpointLinear
from plugins.quant._input_quant import InputQuantLinear

_spec = importlib.util.spec_from_file_location("quantize_checkpoint", REPO / "scripts" / "quantize_checkpoint.py")
qc_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qc_script)

#: name -> (format, quantizer options); stories260K: hidden 64, intermediate 172, so 4-bit GPTQ/AWQ pack only the
#: attention projections (172 is not a multiple of 8) and group 32 leaves down_proj (in 172) float
CHECKPOINTS = {
    "gptq_w4_g32_desc_act_asym": ("gptq", {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}),
    "gptq_w4_g32_sym": ("gptq", {"bits": 4, "group_size": 32, "sym": True}),
    "gptq_w4_channel_asym": ("gptq", {"bits": 4, "group_size": -1, "sym": False}),
    "gptq_w8_channel_sym": ("gptq", {"bits": 8, "group_size": -1, "sym": True}),
    "awq_w4_g32": ("awq", {"bits": 4, "group_size": 32, "sym": False}),
    "ct_w4a16_g32_asym": ("compressed-tensors", {"bits": 4, "group_size": 32, "sym": False}),
    "ct_w8a16_channel_sym": ("compressed-tensors", {"bits": 8, "group_size": -1, "sym": True}),
    "ct_w8a8_int": ("compressed-tensors", {"bits": 8, "group_size": -1, "ct_format": "int-quantized"}),
    "ct_fp8_dynamic": ("compressed-tensors", {"bits": 8, "group_size": -1, "ct_format": "float-quantized"}),
}
#: checkpoints whose layers quantize their inputs too (dynamic per token): name -> (kind, largest level)
INPUT_QUANT = {"ct_w8a8_int": ("int8", 127.0), "ct_fp8_dynamic": ("fp8", 448.0)}
#: Input-quantized checkpoints against their oracle: the engine's and transformers' float kernels round the
#: activations differently in the last bits, which can move a value across an int8/fp8 rounding boundary; the
#: step propagates (as for quant=w8a8, tests/plugins/quant/test_quant_methods.py W8A8_REL_TOL), so their tokens
#: are held within this fraction of max|logit| of the oracle's argmax instead of equal.
INPUT_QUANT_REL_TOL = 2e-2
METHOD = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "compressed_tensors"}
PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park and"]
MAX_NEW = 24
#: Fast path vs reference: the int4 kernel folds zero points into its per-group zero and both kernels sum in
#: another order, so logits differ by float rounding; each fast-path token must have a logit within
#: FAST_REL_TOL * max|logit| of the reference oracle's maximum given the same prefix (a wrong kernel is whole
#: logits away).
FAST_REL_TOL = 1e-3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
    """name -> (folder, layer -> dequantized float32 weight), written once per module."""
    root = tmp_path_factory.mktemp("quantized")
    return {name: (str(root / name), qc_script.quantize_checkpoint(STORIES, root / name, fmt, **opts))
            for name, (fmt, opts) in CHECKPOINTS.items()}


def _fake_quant_inputs(kind: str, top: float):
    """A forward pre-hook quantizing a linear's input per token (scale ``max|x| / top``) and dequantizing it."""
    def hook(module: torch.nn.Module, args: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
        x = args[0]
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
        q = torch.round(x / scale).clamp(-128, 127) if kind == "int8" else (x / scale).to(torch.float8_e4m3fn).float()
        return (q * scale,)
    return hook


def _oracle(name: str, dequantized: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' stories260K with the quantized layers' weights replaced by their dequantized values (and
    their inputs quantized per token for W8A8/FP8 checkpoints)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    unexpected = model.load_state_dict({f"{k}.weight": v for k, v in dequantized.items()}, strict=False).unexpected_keys
    assert not unexpected
    if name in INPUT_QUANT:
        for layer in dequantized:
            model.get_submodule(layer).register_forward_pre_hook(_fake_quant_inputs(*INPUT_QUANT[name]))
    return model


def _assert_near_greedy(oracle: torch.nn.Module, ids: list[int], out: list[int], rel_tol: float) -> None:
    """Each token of ``out`` has a logit within ``rel_tol * max|logit|`` of the oracle's maximum given the prefix."""
    with torch.inference_mode():
        logits = oracle(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1]  # (MAX_NEW, vocab)
    gap = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    assert bool((gap <= rel_tol * logits.abs().max(-1).values).all()), gap.max()


def _hf_greedy(model: torch.nn.Module, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        seq = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return seq[0, len(ids):].tolist()


def _engine_greedy(make_llm, folder: str, kernel: str) -> tuple[list[list[int]], list[list[int]], str]:
    llm = make_llm(model=folder, dtype="float32", quant_params={"kernel": kernel}, num_blocks=64)
    tok = llm.engine.tokenizer
    prompt_ids = [tok(p)["input_ids"] for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True))
    return prompt_ids, [list(o.outputs[0].token_ids) for o in outs], llm.engine.config.quant


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_reference_kernel_matches_transformers_on_dequantized_weights(make_llm, checkpoints, name: str) -> None:
    folder, dequantized = checkpoints[name]
    prompt_ids, outputs, method = _engine_greedy(make_llm, folder, "reference")
    assert method == METHOD[CHECKPOINTS[name][0]]  # detected from config.json (quant=none given)
    oracle = _oracle(name, dequantized)
    for ids, out in zip(prompt_ids, outputs):
        if name in INPUT_QUANT:
            _assert_near_greedy(oracle, ids, out, INPUT_QUANT_REL_TOL)
        else:
            assert out == _hf_greedy(oracle, ids)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_fast_path_agrees_with_reference(make_llm, checkpoints, name: str) -> None:
    folder, dequantized = checkpoints[name]
    prompt_ids, outputs, _ = _engine_greedy(make_llm, folder, "auto")
    oracle = _oracle(name, dequantized)
    for ids, out in zip(prompt_ids, outputs):
        _assert_near_greedy(oracle, ids, out, INPUT_QUANT_REL_TOL if name in INPUT_QUANT else FAST_REL_TOL)


@pytest.mark.parametrize("name, kernel_class", [("gptq_w4_g32_desc_act_asym", Int4CheckpointLinear),
                                                ("awq_w4_g32", Int4CheckpointLinear),
                                                ("ct_w4a16_g32_asym", Int4CheckpointLinear),
                                                ("gptq_w8_channel_sym", Int8CheckpointLinear),
                                                ("ct_w8a8_int", Int8CheckpointLinear),
                                                ("ct_fp8_dynamic", torch.nn.Linear)])
def test_fast_path_layers_and_log(checkpoints, caplog, name: str, kernel_class: type) -> None:
    """Attention projections run the kernel (act-order through an input permutation), each layer's output
    within float rounding of the dequantized weight's; a layer the kernel cannot take falls back, logged why."""
    folder, dequantized = checkpoints[name]
    with caplog.at_level(logging.INFO, logger="plugins.quant._checkpoint"):
        model = registry.create("quant", METHOD[CHECKPOINTS[name][0]]).apply(load_model(folder).model)
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    if name in INPUT_QUANT:
        assert isinstance(q, InputQuantLinear) and "dynamic per-token" in caplog.text
        q = q.inner
    assert type(q) is kernel_class
    if name.startswith("gptq_w4_g32_desc"):
        assert q.in_perm is not None and "act-order input permutation" in caplog.text
    for layer, w in dequantized.items():
        xi = torch.randn(5, w.shape[1])
        ref = (_fake_quant_inputs(*INPUT_QUANT[name])(None, (xi,))[0] if name in INPUT_QUANT else xi) @ w.t()
        assert (model.get_submodule(layer)(xi) - ref).abs().max() <= 1e-5 * ref.abs().max(), layer
    if name == "ct_w4a16_g32_asym":  # gate/up: out_features 172
        assert type(model.get_submodule("model.layers.0.mlp.gate_proj")) is torch.nn.Linear
        assert "gate_proj -> reference" in caplog.text and "not a multiple of 16" in caplog.text


def test_compressed_tensors_library_decompresses_our_checkpoints(checkpoints) -> None:
    pytest.importorskip("compressed_tensors")
    for name in ("ct_w4a16_g32_asym", "ct_w8a16_channel_sym", "ct_w8a8_int", "ct_fp8_dynamic"):
        folder, dequantized = checkpoints[name]
        assert qc_script.check_with_compressed_tensors(Path(folder), dequantized) == len(dequantized) > 0
