"""Test helpers shared by test modules (imported as ``helpers``; ``tests/`` is on pytest's pythonpath)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = str(REPO / "models" / "stories260K")
STORIES_DRAFT = str(REPO / "models" / "stories260K-draft")


def assert_all_blocks_free(engine) -> None:
    """Every KV block is back in the pool and the allocator's invariants hold."""
    kv = engine.kv_allocator
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
    if hasattr(kv, "check_invariants"):
        kv.check_invariants()


_ORACLE_MODELS: dict[tuple[str, str], object] = {}


def hf_greedy(model_path: str, prompt_ids: list[list[int]], max_new_tokens: int, dtype: str = "float32") -> list[list[int]]:
    """transformers ``generate`` greedy continuations, one prompt at a time (no padding effects)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = (model_path, dtype)
    if key not in _ORACLE_MODELS:
        _ORACLE_MODELS[key] = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    model = _ORACLE_MODELS[key]
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(seq[0, len(ids):].tolist())
    return outs
