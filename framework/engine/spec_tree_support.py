"""What token-tree speculative decoding refuses before weights load (``framework/core/spec_tree.py``).

A drafter that proposes trees (``Drafter.drafts_trees``: ``spec_decode=medusa``) needs an attention backend that
honours tree attention (``AttentionBackend.supports_tree_attention``: ``torch``, ``torch_paged``, ``triton``) and one
pipeline stage: after a verify step every tensor-parallel rank moves the accepted path's K/V into place, the driver's
paths reaching the others in one broadcast over the TP group (``framework/worker/spec_tree_ranks.py``), which the
stages of a pipeline do not share. Called by ``validate_plugins`` (``framework/engine/builder.py``).

It also applies ``spec_decode.params.acceptance`` (``exact``, or Medusa's lossy ``typical``:
``framework/sample/typical_acceptance.py``) to every rank's rejection sampler and labels the run with it.
"""

from __future__ import annotations

import logging
from typing import Any

from framework import registry
from framework.config import EngineConfig
from framework.sample.typical_acceptance import TypicalAcceptance, acceptance_from_params

logger = logging.getLogger(__name__)


def tree_problems(config: EngineConfig) -> list[str]:
    """Why ``config`` cannot verify draft trees (empty: it can, or no ``spec_decode.params.tree`` is set, so the
    drafter proposes chains); each problem names its fix."""
    problems = acceptance_problems(config)
    drafter = registry.get_class("drafter", config.drafter)
    if drafter is None or not getattr(drafter, "drafts_trees", False) or config.drafter_params.get("tree") is None:
        return problems  # no tree asked for: the drafter proposes chains
    backend = registry.get_class("attention", config.attention)
    if backend is not None and not getattr(backend, "supports_tree_attention", False):
        problems.append(f"spec_decode={config.drafter} verifies token trees, which attention={config.attention} cannot "
                        "attend (no tree attention); use attention=torch_paged (the CPU default), attention=torch or "
                        "attention=triton (CUDA)")
    if config.pipeline_parallel_size > 1:
        problems.append(f"spec_decode={config.drafter} (token trees) moves each accepted path's K/V within the "
                        "tensor-parallel group only; set parallel.pipeline_parallel_size=1 (tensor_parallel_size may "
                        "stay), or drop spec_decode.params.tree for chains")
    return problems


def acceptance_problems(config: EngineConfig) -> list[str]:
    """Why ``spec_decode.params.acceptance``/``epsilon``/``delta`` are invalid (empty: they are valid or unset)."""
    if config.drafter == "none":
        return []
    try:
        acceptance_from_params(config.drafter_params)
    except (TypeError, ValueError) as e:
        return [f"{e}; use spec_decode.params.acceptance=exact (default) or typical with 0 < epsilon <= 1, delta > 0"]
    return []


def _set_typical(worker: Any, typical: TypicalAcceptance | None) -> None:
    """Run on each rank (``collective_rpc``): its rejection sampler's typical rule (``None``: exact)."""
    worker.runner.rejection_sampler.typical = typical


def apply_acceptance(config: EngineConfig, executor: Any) -> None:
    """Give every rank's rejection sampler the ``spec_decode.params.acceptance`` rule (after
    ``initialize_cache``); logs once that ``typical`` is lossy."""
    typical = acceptance_from_params(config.drafter_params)
    if typical is None:
        return
    logger.warning("spec_decode.params.acceptance=typical (epsilon=%g, delta=%g): Medusa's typical acceptance is "
                   "lossy; random requests do not keep the target distribution", typical.epsilon, typical.delta)
    executor.collective_rpc(_set_typical, args=(typical,))


def acceptance_label(config: EngineConfig) -> dict[str, str]:
    """``{"spec_acceptance": "exact" | "typical"}`` for ``metrics.json`` when speculating, else ``{}``."""
    if config.drafter == "none":
        return {}
    return {"spec_acceptance": config.drafter_params.get("acceptance") or "exact"}
