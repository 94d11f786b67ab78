"""Multi-LoRA's config surface and build-time refusals (no weights load): ``lora.*`` keys and the ``lora_backend``
group map onto ``EngineConfig``; combinations outside this slice are refused by ``validate_plugins`` naming the fix;
``auto`` choices resolve to eager and unfused linears."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import STORIES, STORIES_DRAFT, STORIES_EAGLE
from hydra import compose, initialize_config_dir

from framework.config import EngineConfig
from framework.engine.builder import validate_plugins
from framework.engine.lora_support import resolve_lora_defaults
from framework.entrypoints.hydra_config import engine_config_from_cfg, register_config_nodes

CONF = Path(__file__).resolve().parents[3] / "conf"


def _compose(*overrides: str):
    register_config_nodes()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_lora_is_off_by_default_and_the_keys_map_onto_engine_config():
    off = engine_config_from_cfg(_compose("model=stories260K"))
    assert not off.enable_lora and off.lora_backend == "bgmv"
    on = engine_config_from_cfg(_compose("model=stories260K", "lora.enable=true", "lora.max_loras=3",
                                         "lora.max_lora_rank=32", "lora.max_cpu_loras=5", "lora_backend=sgmv",
                                         "+lora.modules.math=/adapters/math"))
    assert (on.enable_lora, on.max_loras, on.max_lora_rank, on.max_cpu_loras, on.lora_backend) == (
        True, 3, 32, 5, "sgmv")
    assert on.lora_modules == {"math": "/adapters/math"}


def test_an_unknown_lora_key_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown lora keys.*max_lora_rank"):
        engine_config_from_cfg(_compose("model=stories260K", "+lora.max_rank=8"))


def test_knob_ranges():
    with pytest.raises(ValueError, match="max_cpu_loras must be >= max_loras"):
        EngineConfig(model=STORIES, enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1"):
        EngineConfig(model=STORIES, max_lora_rank=0)


@pytest.mark.parametrize("overrides, fix", [
    ({"executor": "ray"}, "use executor=uniproc"),
    ({"quant": "w8a8"}, "'gptq', 'awq', 'compressed_tensors'); use one of them or quant=none"),
    ({"quant": "int8_wo", "tensor_parallel_size": 2, "executor": "mp"}, "use parallel.tensor_parallel_size=1"),
    ({"kv_allocator": "radix"}, "use kv_cache=paged"),
])
def test_combinations_outside_the_slice_are_refused_before_weights_load(overrides, fix):
    config = EngineConfig(model=STORIES, dtype="float32", enable_lora=True, **overrides)
    with pytest.raises(ValueError, match="issue 59") as info:
        validate_plugins(config)
    assert fix in str(info.value)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle"])
def test_speculative_decoding_is_accepted_with_lora(drafter):
    """Drafts are only proposals: the target verifies them under each request's adapter (test_lora_spec_decode)."""
    params = {"draft_model": {"model": STORIES_DRAFT}, "eagle": {"model": STORIES_EAGLE}}.get(drafter, {})
    validate_plugins(EngineConfig(model=STORIES, dtype="float32", enable_lora=True, drafter=drafter,
                                  drafter_params=params))  # raises on a refusal


def test_a_bad_lora_module_folder_is_refused_at_build_time(tmp_path):
    config = EngineConfig(model=STORIES, dtype="float32", enable_lora=True, lora_modules={"math": str(tmp_path)})
    with pytest.raises(ValueError, match="lora.modules.math: .*no adapter_config.json"):
        validate_plugins(config)


def test_auto_choices_resolve_to_eager_with_lora_and_keep_prepacking():
    config = resolve_lora_defaults(EngineConfig(model=STORIES, enable_lora=True))
    assert (config.compile, config.prepack_linears, config.enforce_eager) == ("false", "auto", True)
    plain = EngineConfig(model=STORIES)
    assert resolve_lora_defaults(plain) is plain
