"""What token-tree speculative decoding refuses before weights load (``framework/core/spec_tree.py``).

A drafter that proposes trees (``Drafter.drafts_trees``: ``spec_decode=medusa``) needs an attention backend that
honours tree attention (``AttentionBackend.supports_tree_attention``: ``torch``, ``torch_paged``) and one rank: the
driver rank moves each accepted path's K/V into place right after verifying it, which the other tensor-parallel ranks
would not see. Called by ``validate_plugins`` (``framework/engine/builder.py``).
"""

from __future__ import annotations

from framework import registry
from framework.config import EngineConfig


def tree_problems(config: EngineConfig) -> list[str]:
    """Why ``config`` cannot verify draft trees (empty: it can, or no ``spec_decode.params.tree`` is set, so the
    drafter proposes chains); each problem names its fix."""
    drafter = registry.get_class("drafter", config.drafter)
    if drafter is None or not getattr(drafter, "drafts_trees", False) or config.drafter_params.get("tree") is None:
        return []  # no tree asked for: the drafter proposes chains
    problems = []
    backend = registry.get_class("attention", config.attention)
    if backend is not None and not getattr(backend, "supports_tree_attention", False):
        problems.append(f"spec_decode={config.drafter} verifies token trees, which attention={config.attention} cannot "
                        "attend (no tree attention); use attention=torch_paged (the CPU default) or attention=torch")
    if config.tensor_parallel_size > 1:
        problems.append(f"spec_decode={config.drafter} (token trees) runs on one rank only; set "
                        "parallel.tensor_parallel_size=1")
    return problems
