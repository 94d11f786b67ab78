"""``executor=sim`` with multi-LoRA (``framework/sim/lora_cost.py``): adapter loads and the batched shrink/expand in
the step model, priced from ``adapter_config.json`` alone, so an S-LoRA-style run over 1,000 adapters runs without
their weights."""

from __future__ import annotations

import json
import random

import pytest
from helpers import STORIES

from framework import LoRARequest, SamplingParams
from framework.model_executor.model_loader import load_model_config
from framework.sim.lora_cost import LoRAStepCost, adapter_size


def _adapter(root, name: str, rank: int = 8, targets=("q_proj", "v_proj")) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "target_modules": list(targets)}))
    return str(folder)


def test_an_adapters_size_comes_from_its_config(tmp_path):
    config = load_model_config(STORIES)
    size = adapter_size(LoRARequest("a", 1, _adapter(tmp_path, "a", rank=4, targets=["q_proj"])), config, 8)
    assert size.rank == 4 and size.io_features == config.num_hidden_layers * 2 * config.hidden_size
    assert adapter_size(LoRARequest("a", 1, str(tmp_path / "a")), config, 8, tp_size=2).io_features * 2 == \
        size.io_features


def test_more_distinct_adapters_predict_longer_steps_and_loads_are_counted(tmp_path):
    config = load_model_config(STORIES)
    requests = [LoRARequest(f"a{i}", i + 1, _adapter(tmp_path, f"a{i}")) for i in range(4)]
    tokens = [16] * 4

    def cost(reqs):
        model = LoRAStepCost(config, 2, max_loras=4, max_lora_rank=8, device="h100")
        model.step_s(reqs, tokens)  # the first step loads the adapters
        return model, model.step_s(reqs, tokens)  # the second: compute only

    one, one_s = cost([requests[0]] * 4)
    four, four_s = cost(requests)
    base, base_s = cost([None] * 4)
    assert base_s == 0.0 and base.num_loads == 0
    assert four_s > one_s > 0.0
    assert (one.num_loads, four.num_loads) == (1, 4) and four.load_bytes == 4 * one.load_bytes
    # a fifth adapter through four slots evicts the least recently used one not in the step
    extra = LoRARequest("a4", 5, _adapter(tmp_path, "a4"))
    four.step_s([requests[1], extra], [1, 1])
    assert four.num_loads == 5 and four.slots.count(1) == 0


def test_a_thousand_adapter_simulated_run_completes(tmp_path):
    from framework import build_engine
    from framework.config import EngineConfig
    from framework.entrypoints.offline_runner import run_workload
    from framework.workloads.item import WorkloadItem

    modules = {f"lora{i:04d}": _adapter(tmp_path, f"lora{i:04d}", rank=random.Random(i).choice([8, 16]))
               for i in range(1000)}
    engine = build_engine(EngineConfig(model=STORIES, dtype="bfloat16", compile=False, executor="sim",
                                       executor_params={"profile": "analytic:h100"}, enable_lora=True, max_loras=8,
                                       max_cpu_loras=64, max_lora_rank=16, lora_modules=modules))
    rng = random.Random(0)
    names = sorted(modules)
    items = [WorkloadItem(str(i), prompt_token_ids=[1, 2, 3, 4], lora=rng.choice(names) if i % 10 else None,
                          max_tokens=8) for i in range(3000)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    records, summary = run_workload(engine, items, sampling, progress=False)
    assert all(r.get("error") is None for r in records)
    assert sum(len(r["token_ids"]) for r in records) == 8 * len(items)
    assert len({r["lora"] for r in records}) > 900
    cost = engine.executor.lora_cost
    assert cost.num_loads >= len({r["lora"] for r in records if r["lora"]}) and cost.load_bytes > 0
    # negative control: the same workload on the base model takes less (virtual) time
    base = build_engine(EngineConfig(model=STORIES, dtype="bfloat16", compile=False, executor="sim",
                                     executor_params={"profile": "analytic:h100"}))
    base_items = [WorkloadItem(str(i), prompt_token_ids=[1, 2, 3, 4], max_tokens=8) for i in range(len(items))]
    _, base_summary = run_workload(base, base_items, sampling, progress=False)
    assert summary["duration_s"] > base_summary["duration_s"]


@pytest.mark.parametrize("params, fix", [({"profile": "auto"}, "executor.params.lora_device=")])
def test_a_measured_profile_needs_a_lora_device(params, fix):
    from framework.config import EngineConfig
    from framework.engine.builder import validate_plugins

    config = EngineConfig(model=STORIES, executor="sim", executor_params=params, enable_lora=True)
    with pytest.raises(ValueError, match=fix):
        validate_plugins(config)
