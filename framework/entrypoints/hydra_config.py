"""Hydra glue: auto config nodes for registered plugins, and Hydra config -> ``EngineConfig`` / ``SamplingParams``.

Every registered plugin name is a valid choice of its config group (``scheduler=<name>``) even
when no ``conf/<group>/<name>.yaml`` exists, so a plugin from an installed package needs no file
copied into ``conf/``: :func:`register_config_nodes` stores a ``{name: <name>, params: {}}``
node for it in Hydra's ``ConfigStore``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from framework import registry
from framework.config import (
    DISAGG_FIELDS,
    KV_TRANSFER_FIELDS,
    LORA_FIELDS,
    PARALLEL_FIELDS,
    PLUGIN_FIELDS,
    EngineConfig,
)
from framework.core.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
# engine.* keys map 1:1 onto EngineConfig fields; these come from other parts of the config
_NON_ENGINE_FIELDS = {"model", "dtype", "device", "tokenizer", "seed"} | set(PLUGIN_FIELDS) | {
    f"{kind}_params" for kind in PLUGIN_FIELDS} | set(PARALLEL_FIELDS) | set(LORA_FIELDS.values()) | set(
    KV_TRANSFER_FIELDS.values()) | set(DISAGG_FIELDS.values())


def _repo_path(relative: str = "") -> str:
    """``${repo_path:data/prompts.txt}``: absolute path under the servelab checkout."""
    return str(REPO_ROOT / relative)


OmegaConf.register_new_resolver("repo_path", _repo_path, replace=True)


def register_config_nodes(conf_dir: str | Path = CONF_DIR) -> list[tuple[str, str]]:
    """Store an auto node for every registered plugin name that has no config file.

    Call before Hydra composes (``run.py`` does at import time); safe to call repeatedly, e.g.
    after registering a plugin in a test.

    Returns:
        ``(group, name)`` of each node stored.
    """
    cs = ConfigStore.instance()
    stored = []
    for kind, (_, _, group) in registry.KINDS.items():
        for name in registry.choices(kind):
            if not (Path(conf_dir) / group / f"{name}.yaml").exists():
                cs.store(group=group, name=name, node={"name": name, "params": {}})
                stored.append((group, name))
    return stored


def _plain(node: Any) -> Any:
    """Resolved plain Python value of a config node (dicts, lists, scalars)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def engine_config_from_cfg(cfg: DictConfig) -> EngineConfig:
    """Build the ``EngineConfig`` of a composed run config.

    Reads ``model.path``/``model.dtype`` (optional ``model.tokenizer``), ``device``, ``seed``,
    every ``engine.*`` knob, ``parallel.*`` (``tensor_parallel_size``, ``num_threads_per_rank``), ``lora.*``
    (``enable``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ``modules``,
    ``allow_runtime_updates``; ``LORA_FIELDS``), and
    each plugin group's ``name`` + ``params`` (``kv_cache`` -> ``kv_allocator``, ``spec_decode`` ->
    ``drafter``; a config without an ``executor`` group gets ``auto``).

    Raises:
        ValueError: an unknown ``engine.*``, ``parallel.*``, ``lora.*`` or ``kv_transfer.*`` key (valid keys listed) or a knob out of
            range.
    """
    valid = {f.name for f in dataclasses.fields(EngineConfig)} - _NON_ENGINE_FIELDS
    engine = _plain(cfg.get("engine")) or {}
    parallel = _plain(cfg.get("parallel")) or {}
    lora = _plain(cfg.get("lora")) or {}
    kv_transfer = _plain(cfg.get("kv_transfer")) or {}
    disagg = _plain(cfg.get("disagg")) or {}
    for section, keys, allowed in (("engine", engine, valid), ("parallel", parallel, set(PARALLEL_FIELDS)),
                                   ("lora", lora, set(LORA_FIELDS)), ("kv_transfer", kv_transfer, set(KV_TRANSFER_FIELDS)),
                                   ("disagg", disagg, set(DISAGG_FIELDS))):
        unknown = sorted(set(keys) - allowed)
        if unknown:
            raise ValueError(f"unknown {section} keys {unknown}; valid: {', '.join(sorted(allowed))}")
    kwargs: dict[str, Any] = dict(engine, **parallel, model=cfg.model.path, dtype=cfg.model.dtype,
                                  tokenizer=cfg.model.get("tokenizer"), device=cfg.get("device", "cpu"),
                                  seed=cfg.get("seed", 0), **{LORA_FIELDS[k]: v for k, v in lora.items()},
                                  **{KV_TRANSFER_FIELDS[k]: v for k, v in kv_transfer.items()},
                                  **{DISAGG_FIELDS[k]: v for k, v in disagg.items()})
    for kind in PLUGIN_FIELDS:
        node = cfg.get(registry.KINDS[kind][2])
        if node is None:  # a config composed without this group (older saved runs): the default
            continue
        kwargs[kind] = node.name
        kwargs[f"{kind}_params"] = _plain(node.get("params")) or {}
    return EngineConfig(**kwargs)


def sampling_params_from_cfg(sampling: Mapping[str, Any] | DictConfig) -> SamplingParams:
    """``SamplingParams`` from the ``sampling`` section (vLLM field names).

    Raises:
        ValueError: an unknown key (valid keys listed) or a value out of range.
    """
    values = dict(_plain(sampling) or {})
    valid = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ValueError(f"unknown sampling keys {unknown}; valid: {', '.join(sorted(valid))}")
    return SamplingParams(**values)
