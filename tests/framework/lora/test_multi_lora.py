"""Multi-LoRA serving end to end on stories260K (float32, greedy), with PEFT's ``PeftModel`` as the oracle.

Three adapters of different ranks and targets (one rsLoRA) are made with PEFT at test time; a mixed batch of them and
the base model runs with ``max_loras=2`` (so device slots swap) and ``max_cpu_loras=2`` (so an adapter is evicted from
the CPU cache and read again), and must equal PEFT token for token under every ``lora_backend``. Negative controls:
adapters change the output, no step holds more than ``max_loras`` adapters, one prompt under two adapters shares no
cached block. A bad adapter fails its own request only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import STORIES
from lora_peft import NUM_TOKENS, PROMPTS, SPECS

from framework import LLM, LoRARequest, SamplingParams

# transformers deprecation inside PEFT's get_peft_model, not ours
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def _llm(**kwargs) -> LLM:
    return LLM(STORIES, dtype="float32", enable_lora=True, max_lora_rank=8, num_blocks=128, **kwargs)


def _record_adapters_per_step(llm: LLM) -> list[set[int]]:
    steps: list[set[int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append({r.lora_request.lora_int_id for r in out.scheduled_requests if r.lora_request is not None})
        return out
    llm.engine.scheduler.schedule = recording
    return steps


@pytest.mark.parametrize("backend", ["bgmv", "sgmv", "loop"])
def test_a_mixed_batch_equals_peft_token_for_token(backend, adapters, oracle):
    llm = _llm(max_loras=2, max_cpu_loras=2, lora_backend=backend)
    steps = _record_adapters_per_step(llm)
    names = ["attn", None, "mlp", "all", "attn", None, "all", "mlp", "attn"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                        lora_request=[adapters[n] if n else None for n in names])
    for prompt, name, out in zip(prompts, names, outs):
        assert out.error is None
        assert out.outputs[0].token_ids == oracle(prompt, name), (prompt, name)
    assert max(len(s) for s in steps) == 2  # mixed, and never more than max_loras
    stats = llm.engine.executor.worker.lora.stats()
    assert stats["num_slot_swaps"] >= 3 and len(stats["cpu_cached"]) == 2


def test_each_adapter_changes_the_output(oracle):
    for prompt in PROMPTS:
        base = oracle(prompt, None)
        assert all(oracle(prompt, name) != base for name in SPECS), prompt


def _write_adapter(folder: Path, config: dict, tensors: dict[str, torch.Tensor] | bytes) -> LoRARequest:
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if isinstance(tensors, bytes):
        (folder / "adapter_model.safetensors").write_bytes(tensors)
    else:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return LoRARequest(folder.name, 100 + len(list(folder.parent.iterdir())), str(folder))


def test_bad_adapters_fail_their_request_only_and_prefix_blocks_are_per_adapter(adapters, oracle, tmp_path):
    key = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"
    ok = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    bad = {
        "rank": (_write_adapter(tmp_path / "rank", dict(ok, r=16), {
            key.format(0, "q_proj", "A"): torch.zeros(16, 64), key.format(0, "q_proj", "B"): torch.zeros(64, 16)}),
            "exceeds lora.max_lora_rank=8"),
        "module": (_write_adapter(tmp_path / "module", ok, {
            key.format(0, "rotary", "A"): torch.zeros(4, 64), key.format(0, "rotary", "B"): torch.zeros(64, 4)}),
            "no LoRA-targetable module"),
        "other model": (_write_adapter(tmp_path / "other", ok, {
            key.format(0, "q_proj", "A"): torch.zeros(4, 96), key.format(0, "q_proj", "B"): torch.zeros(96, 4)}),
            "trained for another base model"),
        "corrupt": (_write_adapter(tmp_path / "corrupt", ok, b"not a safetensors file"), "cannot be read"),
        "missing": (LoRARequest("missing", 99, str(tmp_path / "nowhere")), "no adapter_config.json"),
    }
    llm = _llm(max_loras=2, block_size=4)
    sp = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0)
    requests = [adapters["attn"]] + [lora for lora, _ in bad.values()] + [None]
    outs = llm.generate([PROMPTS[2]] * len(requests), sp, lora_request=requests)
    assert outs[0].error is None and outs[0].outputs[0].token_ids == oracle(PROMPTS[2], "attn")
    assert outs[-1].error is None and outs[-1].outputs[0].token_ids == oracle(PROMPTS[2], None)
    for out, (name, (_, message)) in zip(outs[1:-1], bad.items()):
        assert out.error is not None and message in out.error, (name, out.error)
    # the prompt's blocks are cached under "attn" and the base model: "mlp" reuses neither, "attn" its own
    cached = {name: llm.generate(PROMPTS[2], sp, lora_request=adapters[name])[0].num_cached_tokens
              for name in ("mlp", "attn")}
    assert cached["mlp"] == 0 and cached["attn"] > 0


def test_an_adapter_without_enable_lora_is_rejected(adapters):
    llm = LLM(STORIES, dtype="float32", num_blocks=32)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), lora_request=adapters["attn"])[0]
    assert out.error is not None and "enable_lora=True" in out.error


def test_a_workload_line_names_its_adapter_from_lora_modules(adapters, oracle, tmp_path):
    """``+lora.modules.NAME=PATH`` and a JSONL line's ``"lora": NAME``: that request runs under the adapter (PEFT's
    tokens), a line without one under the base model, an unknown name fails its own request naming the override."""
    from framework.entrypoints.offline_runner import run_workload
    from framework.workloads.workload import load_prompts

    lines = [{"prompt": PROMPTS[0], "lora": "attn"}, {"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1], "lora": "mlp"},
             {"prompt": PROMPTS[1], "lora": "nope"}]
    path = tmp_path / "workload.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    llm = _llm(max_loras=2, lora_modules={name: adapters[name].lora_path for name in ("attn", "mlp")})
    items = load_prompts(path, chat=False, tokenizer=llm.get_tokenizer())
    records, _ = run_workload(llm.engine, items, SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS),
                              progress=False)
    assert [r["lora"] for r in records] == ["attn", None, "mlp", "nope"]
    assert records[0]["token_ids"] == oracle(PROMPTS[0], "attn") != records[1]["token_ids"]
    assert records[1]["token_ids"] == oracle(PROMPTS[0], None)
    assert records[2]["token_ids"] == oracle(PROMPTS[1], "mlp")
    assert records[3]["finish_reason"] == "abort" and "+lora.modules.nope=" in records[3]["error"]
