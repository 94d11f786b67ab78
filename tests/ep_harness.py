"""Expert-parallel ranks for the EP tests: run in each rank of a ``tp_harness.spawn_ranks`` gloo group.

Importable by the spawned children because ``tests/`` is on pytest's pythonpath.
"""

from __future__ import annotations

from typing import Any

import torch
from tp_harness import greedy


def run_ep_cases(tp_rank: int, tp_size: int, cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case (``name``, ``path``, ``prompt``, ``new_tokens``, ``ep``: ``ExpertParallelConfig`` keyword
    arguments): load this rank's expert-parallel shard (float32, eager attention), record the greedy
    continuation, the measured expert load, the local slots; with ``enable_eplb`` also rebalance from
    that load and record a second greedy continuation and the new maps."""
    from framework.model_executor.expert_parallel import (
        ExpertParallelConfig,
        ep_layers,
        expert_load,
        load_ep_model,
        rebalance,
    )

    results = {}
    for case in cases:
        ep = ExpertParallelConfig(**case["ep"])
        lm = load_ep_model(case["path"], "float32", "cpu", tp_rank, tp_size, "eager", ep)
        layers = ep_layers(lm.model)
        res: dict[str, Any] = {
            "tokens": greedy(lm.model, case["prompt"], case["new_tokens"], tp_rank),
            "load": expert_load(lm.model), "num_layers": len(layers),
            "local_slots": [layer.local_slots().tolist() for layer in layers],
            "expert_shapes": [tuple(layer.experts.gate_up_proj.shape) for layer in layers]}
        if ep.enable_eplb:
            maps = rebalance(lm.model)
            res["maps"] = maps
            res["local_slots_after"] = [layer.local_slots().tolist() for layer in layers]
            res["tokens_after"] = greedy(lm.model, case["prompt"], case["new_tokens"], tp_rank)
        results[case["name"]] = res
        del lm
        torch.set_num_threads(1)
    return results


def eplb_rebalances(worker: Any) -> int:
    """Run on a rank by ``collective_rpc``: how many times its ``EplbSchedule`` rebalanced the experts."""
    return worker.runner.model.eplb_schedule.num_rebalances
