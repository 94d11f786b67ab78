"""Every config in conf/ composes and maps onto an EngineConfig; plugins need no conf file to be a choice."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf

from framework import hookimpl, registry
from framework.entrypoints.hydra_config import engine_config_from_cfg, register_config_nodes, sampling_params_from_cfg
from framework.interfaces import SchedulerPolicy

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "experiment")
OPTIONS = [f"{g}={f.stem}" for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))]
EXPERIMENTS = [f"experiment={f.stem}" for f in sorted((CONF / "experiment").glob("*.yaml"))]


def _compose(*overrides: str):
    register_config_nodes()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_conf_has_every_group_and_a_preset():
    assert {"model", "scheduler", "attention", "kv_cache", "spec_decode", "quant", "grammar", "workload",
            "tracker"} <= set(GROUPS)
    assert EXPERIMENTS


@pytest.mark.parametrize("override", OPTIONS + EXPERIMENTS)
def test_every_option_composes_and_builds_engine_config(override):
    cfg = _compose(override)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    config = engine_config_from_cfg(cfg)
    sampling_params_from_cfg(cfg.sampling)
    group, option = override.split("=")
    if group in ("scheduler", "attention", "kv_cache", "spec_decode", "quant", "grammar"):
        kind = next(k for k, (_, _, grp) in registry.KINDS.items() if grp == group)
        assert getattr(config, kind) == option


def test_defaults_map_onto_engine_config():
    cfg = _compose()
    config = engine_config_from_cfg(cfg)
    assert (config.model, config.dtype, config.scheduler, config.kv_allocator, config.attention) == (
        "smollm2", "auto", "fcfs", "paged", "torch_paged")
    assert (config.drafter, config.quant, config.grammar) == ("none", "none", "xgrammar")
    assert config.max_num_batched_tokens == 2048 and config.kv_cache_memory_bytes == 1 << 30
    assert sampling_params_from_cfg(cfg.sampling).greedy
    assert Path(cfg.workload.path).is_absolute() and Path(cfg.workload.path).is_file()


def test_chunked_prefill_preset_holds_deltas():
    base, preset = _compose(), _compose("experiment=chunked_prefill")
    assert preset.engine.max_num_batched_tokens < base.engine.max_num_batched_tokens
    assert preset.engine.long_prefill_token_threshold > 0
    assert preset.scheduler == base.scheduler


@pytest.mark.parametrize("kind", sorted(registry.KINDS))
def test_every_registered_name_is_composable(kind):
    group = registry.KINDS[kind][2]
    for name in registry.choices(kind):
        cfg = _compose(f"{group}={name}")
        assert cfg[group].name == name


def test_unknown_option_lists_valid_choices():
    with pytest.raises(HydraException) as info:
        _compose("scheduler=nope")
    message = str(info.value)
    assert "nope" in message and "fcfs" in message and "priority" in message


def test_unknown_engine_key_lists_valid_keys():
    cfg = _compose("+engine.max_num_seq=3")
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config_from_cfg(cfg)


class ThrowawayPolicy(SchedulerPolicy):
    """Last-in-first-out: the newest request is admitted first (observable with max_num_seqs=1)."""

    name = "throwaway"

    def __init__(self, **params):
        self.params = params  # accepts any params, to show they arrive from the Hydra config

    def key(self, request):
        return (-request.seq_no,)


class ThrowawayPlugin:
    @hookimpl
    def register_schedulers(self, register):
        register("throwaway", ThrowawayPolicy)


def test_plugin_without_conf_file_becomes_a_choice_and_drives_the_engine():
    from framework import SamplingParams, build_engine

    with registry.registered(ThrowawayPlugin()):
        assert ("scheduler", "throwaway") in register_config_nodes()
        try:
            cfg = _compose("scheduler=throwaway", "+scheduler.params.x=1", "model=stories260K",
                           "engine.max_num_seqs=1")
            config = engine_config_from_cfg(cfg)
            assert config.scheduler == "throwaway" and config.scheduler_params == {"x": 1}
            engine = build_engine(config)
            assert isinstance(engine.scheduler.policy, ThrowawayPolicy) and engine.scheduler.policy.params == {"x": 1}
            for rid in ("first", "second", "third"):
                engine.add_request(rid, [1, 5, 9], SamplingParams(max_tokens=3, ignore_eos=True))
            finished = []
            while engine.has_unfinished_requests():
                finished += [o.request_id for o in engine.step() if o.finished]
            assert finished == ["third", "second", "first"]
        finally:
            ConfigStore.instance().repo["scheduler"].pop("throwaway.yaml", None)
