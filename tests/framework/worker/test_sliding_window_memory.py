"""Sliding-window KV memory end to end (``kv_cache=paged`` with KV cache groups): a request's out-of-window
blocks are released while greedy output stays equal to transformers', the engine's metrics report what
each request held, an allocator without the capability runs correctly without the saving (and says so),
releasing one block too many is caught (negative controls: wrong tokens in the engine, an assertion in
the shadow cache), and a worker-style mirror that keeps released ids (append-only block deltas) changes
nothing.

Tiny models and the transformers oracle come from ``tests/families.py``: window 7, blocks of 4, contexts
of 20 to 53 tokens (three to seven windows), chunked prefill, prefix hits and preemption forced. The
family parity tests (``test_families.py``) and spec decode on gpt-oss (``test_family_plugins.py``: verify
rows through released windows) run the same release path.
"""

from __future__ import annotations

import logging

import pytest
from families import (
    ENGINE,
    MAX_TOKENS,
    WINDOW,
    assert_matches_transformers,
    engine_for,
    hf_reference,
    prompts,
    run_family,
    tiny_model_dir,
)

from framework import SamplingParams
from framework.interfaces import KVCacheGroup
from framework.testing.shadow_cache import check_against_shadow_cache
from plugins.kv_allocators.paged import PagedKVAllocator


def _window_blocks(chunk: int) -> int:
    """Most blocks a sliding group holds: the window's keys before a chunk, the chunk, one for alignment."""
    return -(-(WINDOW - 1 + chunk) // ENGINE["block_size"]) + 1


def test_gemma3_releases_window_blocks_with_swap_preemption(make_llm):
    """Gemma 3 (two sliding layers, one full): each request's sliding groups end holding at most the
    window's blocks, its full group the whole context; swap preemption swaps what they still hold; the
    metrics' bytes are the blocks times the block's bytes; output equals transformers'."""
    llm, outs = run_family(make_llm, "gemma3", attention="torch", preemption_mode="swap", swap_space_bytes=1 << 20)
    assert_matches_transformers("gemma3", outs, "release + swap")
    engine = llm.engine
    assert [g.sliding_window for g in engine.runner.kv_cache_layout.groups] == [None, WINDOW, WINDOW]
    summary = engine.metrics.summary()
    assert summary["num_preemptions_swap"] > 0 and engine.kv_allocator.stats().hit_rate > 0, summary
    chunk = ENGINE["max_num_batched_tokens"]
    for prompt, out in zip(prompts(), outs):
        context = len(prompt) + MAX_TOKENS - 1  # the last output token is sampled, never computed
        full, *sliding = out.metrics.kv_blocks
        assert full == -(-context // ENGINE["block_size"]) > _window_blocks(chunk)
        assert all(0 < n <= _window_blocks(chunk) for n in sliding), out.metrics.kv_blocks
        assert out.metrics.kv_bytes == sum(out.metrics.kv_blocks) * engine.runner.block_bytes
        assert out.metrics.kv_bytes <= out.metrics.peak_kv_bytes <= (full + 2 * _window_blocks(chunk)) * \
            engine.runner.block_bytes
    assert summary["kv_cache_group_windows"] == f"full {WINDOW} {WINDOW}" and summary["kv_cache_layers_per_block"] == 1


def test_an_allocator_without_groups_runs_without_the_saving(make_llm, caplog):
    """``kv_cache=radix`` does not declare ``supports_kv_cache_groups``: one full block table per request
    for every layer (windowed layers mask by position), a start-up warning, and the same greedy output."""
    with caplog.at_level(logging.WARNING, logger="framework.engine.builder"):
        llm, outs = run_family(make_llm, "gemma3", attention="torch", kv_allocator="radix", num_blocks=30)
    assert any("without the sliding-window memory saving" in r.message for r in caplog.records)
    assert len(llm.engine.runner.kv_cache_layout.groups) == 1
    assert_matches_transformers("gemma3", outs, "radix")
    assert all(len(out.metrics.kv_blocks) == 1 for out in outs)


def _one_block_too_many(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every sliding group release the block right after those out of the window (still read)."""
    rule = KVCacheGroup.num_skipped_blocks

    def too_many(self: KVCacheGroup, num_computed_tokens: int, block_size: int) -> int:
        n = rule(self, num_computed_tokens, block_size)
        return n + 1 if self.sliding_window is not None and num_computed_tokens >= self.sliding_window else n

    monkeypatch.setattr(KVCacheGroup, "num_skipped_blocks", too_many)


def test_negative_control_releasing_one_block_too_many_breaks_parity(make_llm, monkeypatch):
    """The parity check sees the release: one block too many (its entry pointing at the null block, zeros)
    and Mistral's output no longer equals transformers'."""
    _one_block_too_many(monkeypatch)
    llm = make_llm(model=str(tiny_model_dir("mistral")), attention="torch", **engine_for("mistral"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(temperature=0.0,
                                                                                     max_tokens=MAX_TOKENS))
    expected = [tokens for tokens, _ in hf_reference("mistral", prompts(), MAX_TOKENS)]
    assert [out.outputs[0].token_ids for out in outs] != expected, "releasing a block still in the window went unnoticed"


def test_negative_control_shadow_cache_catches_one_block_too_many(monkeypatch):
    _one_block_too_many(monkeypatch)
    with pytest.raises(AssertionError, match="null block|holds nothing"):
        check_against_shadow_cache(PagedKVAllocator, policies=("fcfs",), num_workloads=10)


def test_a_mirror_keeping_released_ids_gives_the_same_output(make_llm):
    """What a worker mirroring only appended block ids sees (the executor's per-step deltas): a sliding
    group's released entries keep their old ids, whose blocks other requests and groups have since
    rewritten. ``attention=torch`` gathers every listed block and masks by position, so Gemma 3's output
    still equals transformers'."""
    llm = make_llm(model=str(tiny_model_dir("gemma3")), attention="torch", **engine_for("gemma3"))
    runner, null = llm.engine.runner, llm.engine.kv_allocator.null_block
    mirrors: dict[str, list[list[int]]] = {}
    stale = []
    execute = runner.execute_scheduled  # the worker's view of each step (after its InputBatch)

    def execute_with_mirrors(so):
        for rid, tables in so.block_ids.items():
            mirror = mirrors.get(rid)
            if mirror is None or any(b != null and b != m for t, old in zip(tables, mirror) for b, m in zip(t, old)):
                mirror = mirrors[rid] = [list(t) for t in tables]  # new or re-admitted: the whole table
            for t, old in zip(tables, mirror):
                old += t[len(old):]
            stale.append(sum(b == null and m != null for t, old in zip(tables, mirror) for b, m in zip(t, old)))
            so.block_ids[rid] = tuple(mirror)
        return execute(so)

    runner.execute_scheduled = execute_with_mirrors
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], SamplingParams(temperature=0.0,
                                                                                     max_tokens=MAX_TOKENS))
    assert max(stale) > 0, "no released entry was ever read through a stale id"
    expected = [tokens for tokens, _ in hf_reference("gemma3", prompts(), MAX_TOKENS)]
    assert [out.outputs[0].token_ids for out in outs] == expected
