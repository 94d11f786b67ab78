"""Pre-quantized checkpoints: bad files refused naming the tensor, ``quant=`` checked against the file, the
packings round-tripped (against the compressed-tensors library where installed, by hand-computed words else)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, STORIES

from framework import registry
from framework.config import EngineConfig
from framework.model_executor.model_loader import load_model
from framework.model_executor.quantized_checkpoint import resolve_checkpoint_quant
from plugins.quant._packing import awq_pack, awq_unpack, ct_pack, ct_unpack, pack_int32, unpack_int32

_spec = importlib.util.spec_from_file_location("quantize_checkpoint", REPO / "scripts" / "quantize_checkpoint.py")
qc_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qc_script)
LAYER = "model.layers.0.self_attn.k_proj"


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gptq") / "ckpt"
    qc_script.quantize_checkpoint(STORIES, folder, "gptq", bits=4, group_size=32, sym=False)
    return folder


@pytest.fixture(scope="module")
def ct_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ct") / "ckpt"
    qc_script.quantize_checkpoint(STORIES, folder, "compressed-tensors", bits=4, group_size=32, sym=False)
    return folder


def _variant(src: Path, dst: Path, config_update: dict | None = None, drop: str | None = None,
             replace: dict[str, torch.Tensor] | None = None) -> str:
    """A copy of checkpoint ``src`` with its quantization_config updated and one tensor dropped or replaced."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(config_update or {})
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dst / "model.safetensors"))
    if drop:
        del tensors[drop]
    tensors.update(replace or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


def _apply(folder: str, method: str) -> None:
    registry.create("quant", method).apply(load_model(folder).model)


def test_wrong_bits_refused_naming_the_tensor(gptq_folder, tmp_path) -> None:
    folder = _variant(gptq_folder, tmp_path / "b", {"bits": 8})  # 4-bit tensors, config says 8
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.qweight has shape \(8, 64\), "
                                         r"expected \(16, 64\)"):
        _apply(folder, "gptq")
    with pytest.raises(ValueError, match="bits=3; only 4 and 8"):
        _apply(_variant(gptq_folder, tmp_path / "b3", {"bits": 3}), "gptq")


def test_missing_scales_refused_naming_the_tensor(gptq_folder, ct_folder, tmp_path) -> None:
    with pytest.raises(ValueError, match=f"checkpoint tensor {LAYER}.scales is missing"):
        _apply(_variant(gptq_folder, tmp_path / "g", drop=f"{LAYER}.scales"), "gptq")
    with pytest.raises(ValueError, match=f"checkpoint tensor {LAYER}.weight_scale is missing"):
        _apply(_variant(ct_folder, tmp_path / "c", drop=f"{LAYER}.weight_scale"), "compressed_tensors")


def test_shapes_that_do_not_divide_refused(gptq_folder, ct_folder, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: group_size=48 does not divide "
                                         r"in_features=64"):
        _apply(_variant(gptq_folder, tmp_path / "g", {"group_size": 48}), "gptq")
    bad = torch.zeros(32, 9, dtype=torch.int32)  # k_proj (32, 64) at 4 bits packs into 8 words a row
    with pytest.raises(ValueError, match=f"{LAYER}.weight_packed has shape \\(32, 9\\), expected \\(32, 8\\)"):
        _apply(_variant(ct_folder, tmp_path / "c", replace={f"{LAYER}.weight_packed": bad}), "compressed_tensors")


def test_orphan_quantized_tensor_refused(gptq_folder, tmp_path) -> None:
    extra = {"model.layers.0.self_attn.nope.qweight": torch.zeros(8, 64, dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.nope\.qweight belongs to no nn\.Linear"):
        _apply(_variant(gptq_folder, tmp_path / "o", replace=extra), "gptq")


def test_quant_checked_against_the_file(gptq_folder) -> None:
    from transformers import AutoConfig

    mc = AutoConfig.from_pretrained(str(gptq_folder))
    assert resolve_checkpoint_quant(EngineConfig(model=str(gptq_folder)), mc) == "gptq"
    assert resolve_checkpoint_quant(EngineConfig(model=str(gptq_folder), quant="gptq"), mc) == "gptq"
    for other in ("awq", "int8_wo"):
        with pytest.raises(ValueError, match=f"gptq checkpoint .* but quant={other}: drop quant="):
            resolve_checkpoint_quant(EngineConfig(model=str(gptq_folder), quant=other), mc)
    mc.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="'bitsandbytes'.*loadable formats: \\['awq', 'compressed-tensors', 'gptq'\\]"):
        resolve_checkpoint_quant(EngineConfig(model=str(gptq_folder)), mc)


def test_validate_refuses_float_checkpoint(gptq_folder) -> None:
    gptq = registry.get_class("quant", "gptq")
    assert any("has no quantization_config" in p for p in gptq.validate(EngineConfig(model=STORIES, quant="gptq")))
    # LoRA over a GPTQ checkpoint runs (tests/framework/lora/test_lora_quant.py)
    assert not gptq.validate(EngineConfig(model=str(gptq_folder), quant="gptq", enable_lora=True))
    # group 32 splits whole over TP=2 (o_proj: 32 inputs per rank); a group a shard splits: test_checkpoint_tp.py
    assert gptq.validate_tp(EngineConfig(model=str(gptq_folder), quant="gptq"), 2) == []
    awq_problems = registry.get_class("quant", "awq").validate(EngineConfig(model=str(gptq_folder), quant="awq"))
    assert "is a gptq checkpoint; use quant=none (detected)" in awq_problems[0]


def test_gptq_and_awq_word_layouts() -> None:
    cols = torch.arange(8).view(1, 8)
    assert int(awq_pack(cols)[0, 0]) == 0x75316420  # slot i holds column [0, 2, 4, 6, 1, 3, 5, 7][i]
    assert int(pack_int32(cols.t(), 4, dim=0)[0, 0]) == 0x76543210  # GPTQ qweight: row k at bits 4k
    v = torch.randint(0, 16, (24, 16))
    assert torch.equal(awq_unpack(awq_pack(v)), v)
    for bits, dim in ((4, 0), (4, 1), (8, 0), (8, 1)):
        w = torch.randint(0, 2**bits, (32, 32))
        assert torch.equal(unpack_int32(pack_int32(w, bits, dim), bits, dim), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim, shape", [(1, (6, 172)), (0, (172, 3)), (1, (4, 64))])
def test_compressed_tensors_packing_equals_the_library(bits: int, dim: int, shape: tuple[int, int]) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), shape, dtype=torch.int8)
    ours = ct_pack(values, bits, dim)
    assert torch.equal(ours, helpers.pack_to_int32(values, bits, packed_dim=dim))
    assert torch.equal(ct_unpack(ours, bits, shape[dim], dim).to(torch.int8),
                       helpers.unpack_from_int32(ours, bits, torch.Size(shape), packed_dim=dim))


def test_fp8_static_input_scale(tmp_path) -> None:
    """A static per-tensor ``input_scale`` quantizes the inputs with that scale; a missing one is named."""
    src = tmp_path / "fp8"
    deq = qc_script.quantize_checkpoint(STORIES, src, "compressed-tensors", bits=8, group_size=-1,
                                        ct_format="float-quantized")
    groups = json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]
    groups["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    scales = {f"{layer}.input_scale": torch.tensor([0.02]) for layer in deq}
    model = load_model(_variant(src, tmp_path / "static", {"config_groups": groups}, replace=scales)).model
    model = registry.create("quant", "compressed_tensors").apply(model)
    x = torch.randn(4, 64)
    x_q = (x / 0.02).to(torch.float8_e4m3fn).float() * 0.02
    ref = x_q @ deq[LAYER].t()
    assert (model.get_submodule(LAYER)(x) - ref).abs().max() <= 1e-5 * ref.abs().max()
    del scales[f"{LAYER}.input_scale"]
    folder = _variant(src, tmp_path / "missing", {"config_groups": groups}, replace=scales)
    with pytest.raises(ValueError, match=f"checkpoint tensor {LAYER}.input_scale is missing"):
        _apply(folder, "compressed_tensors")


def test_compressed_tensors_schemes_not_loaded_are_named() -> None:
    cls = registry.get_class("quant", "compressed_tensors")
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    asym_in = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "token", "dynamic": True}
    qc = {"format": "int-quantized", "kv_cache_scheme": {"num_bits": 8},
          "config_groups": {"a": {"targets": ["Linear"], "weights": weights, "input_activations": asym_in},
                            "b": {"targets": ["Linear"], "weights": weights, "format": "naive-quantized"},
                            "c": {"targets": ["Linear"], "weights": {**weights, "strategy": "block"},
                                  "output_activations": {"num_bits": 8}}}}
    problems = "\n".join(cls.config_problems(qc))
    assert "kv_cache_scheme is not loaded" in problems
    assert "config_groups.a.input_activations: only symmetric dynamic per-token or static per-tensor" in problems
    assert "config_groups.b: format 'naive-quantized' is not loaded" in problems
    assert "config_groups.c.weights.strategy='block'" in problems and "config_groups.c.output_activations" in problems


def test_gptq_v2_zero_points_stored_as_they_are(gptq_folder, tmp_path) -> None:
    """The same checkpoint in gptq_v2 (zero points without v1's minus 1) dequantizes to the same weights."""
    from safetensors.torch import load_file

    tensors = load_file(str(gptq_folder / "model.safetensors"))
    v2 = {k: pack_int32(unpack_int32(v, 4, dim=1) + 1, 4, dim=1) for k, v in tensors.items() if k.endswith("qzeros")}
    v1_model = registry.create("quant", "gptq", kernel="reference").apply(load_model(str(gptq_folder)).model)
    folder = _variant(gptq_folder, tmp_path / "v2", {"checkpoint_format": "gptq_v2"}, replace=v2)
    v2_model = registry.create("quant", "gptq", kernel="reference").apply(load_model(folder).model)
    assert torch.equal(v1_model.get_submodule(LAYER).weight, v2_model.get_submodule(LAYER).weight)
    with pytest.raises(ValueError, match="checkpoint_format='marlin'"):
        _apply(_variant(gptq_folder, tmp_path / "m", {"checkpoint_format": "marlin"}), "gptq")


def test_servelab_models_names_the_checkpoint_formats() -> None:
    from framework.entrypoints.model_info import checkpoint_formats

    assert checkpoint_formats() == ("awq (quant=awq), compressed-tensors (quant=compressed_tensors), "
                                    "gptq (quant=gptq)")
