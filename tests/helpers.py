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
_ORACLE_OUTPUTS: dict[tuple, list[int]] = {}  # memoized greedy continuations


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
            cache_key = (model_path, dtype, tuple(ids), max_new_tokens)
            if cache_key not in _ORACLE_OUTPUTS:
                seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long))
                _ORACLE_OUTPUTS[cache_key] = seq[0, len(ids):].tolist()
            outs.append(_ORACLE_OUTPUTS[cache_key])
    return outs
