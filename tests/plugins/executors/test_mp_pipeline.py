"""``executor=mp`` (and ``ray``) with ``parallel.pipeline_parallel_size``: stages of stories260K's 5 layers in
worker processes, hidden states handed stage to stage, a batch per stage in flight.

Greedy float32 tokens equal transformers' for PP=2 (vLLM's split) and PP=3 (an explicit ``pp_layer_partition``,
honoured by each stage), TP=2 x PP=2 (4 ranks, two batches in flight), the stages as Ray actors, and SmolLM2's layout (in a tiny
model) at PP=2, over a workload that chunks prefills, hits the prefix cache and swaps preempted requests out and
back. Each stage holds only its own layers' KV tensors. Refusals come before any rank starts; a killed stage fails
every request in flight and leaves no process or ``/dev/shm`` segment. The split's arithmetic (every size, the
override) is ``tests/framework/model_executor/test_pipeline_parallel.py``'s.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import time

import pytest
from executor_workload import ENGINE, MAX_TOKENS
from helpers import PREFIX_PROMPTS, STORIES, STORY_PROMPTS, hf_greedy, smollm2_layout_model

from framework import LLM, SamplingParams
from framework.interfaces import EngineDeadError
from framework.testing.leftovers import new_shm_names, shm_snapshot, wait_for_nothing_left

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)

#: the executor tests' engine without a drafter (speculative decoding is refused under PP)
PP_ENGINE = {**ENGINE, "drafter": "none", "drafter_params": {}}


def _check_parity(llm: LLM, what: str) -> None:
    """Greedy tokens of the mixed workload equal transformers'; preemption (swap) and prefix hits happened."""
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in PREFIX_PROMPTS[:4] + STORY_PROMPTS[:5]]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for i, (out, exp) in enumerate(zip(outs, hf_greedy(STORIES, ids, MAX_TOKENS))):
        assert out.outputs[0].token_ids == exp, f"prompt {i} diverged from transformers under {what}"
    summary = llm.engine.metrics.summary()
    assert summary["num_preemptions_swap"] > 0 and summary["prefix_cache_hit_rate"] > 0


@pytest.fixture(scope="module")
def pp2_llm():
    llm = LLM(executor="mp", pipeline_parallel_size=2, **PP_ENGINE)
    yield llm
    llm.engine.shutdown()


def test_pp2_greedy_parity(pp2_llm):
    _check_parity(pp2_llm, "pipeline_parallel_size=2")


def test_each_stage_holds_only_its_layers(pp2_llm):
    """vLLM's split of 5 layers over 2 stages is 3 + 2; each stage's KV block holds only its layers'
    K and V, and the LM head lives on the last stage only."""
    executor = pp2_llm.engine.executor
    assert executor.world_size == 2 and executor.driver_rank == 1
    info = executor.collective_rpc(_stage_info)
    assert [i["stage_layers"] for i in info] == [(0, 3), (3, 5)]
    assert [i["kv_tensors"] for i in info] == [3, 2]
    assert info[0]["block_bytes"] * 2 == info[1]["block_bytes"] * 3
    assert [i["missing"] for i in info] == [["lm_head", "model.layers.3", "model.layers.4", "model.norm"],
                                            ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                             "model.layers.2"]]


def _stage_info(worker) -> dict:
    from framework.model_executor.pipeline_parallel import PPMissingLayer

    model = worker.runner.model
    return {"stage_layers": worker.stage_layers, "kv_tensors": len(worker.runner.kv_tensors),
            "block_bytes": worker.runner.block_bytes,
            "missing": sorted(n for n, m in model.named_modules() if isinstance(m, PPMissingLayer))}


def test_three_stages_with_an_explicit_partition_keep_parity():
    """PP=3: a middle stage both receives and hands on hidden states; ``pp_layer_partition="1,1,3"`` reaches every
    stage (each builds and caches only its layers)."""
    llm = LLM(executor="mp", pipeline_parallel_size=3, pp_layer_partition="1,1,3", **PP_ENGINE)
    try:
        info = llm.engine.executor.collective_rpc(_stage_info)
        assert [i["stage_layers"] for i in info] == [(0, 1), (1, 2), (2, 5)]
        assert [i["kv_tensors"] for i in info] == [1, 1, 3]
        _check_parity(llm, "pipeline_parallel_size=3 pp_layer_partition='1,1,3'")
    finally:
        llm.engine.shutdown()


def test_tp2_x_pp2_on_four_ranks_keeps_parity():
    llm = LLM(executor="mp", tensor_parallel_size=2, pipeline_parallel_size=2, **PP_ENGINE)
    try:
        executor = llm.engine.executor
        assert executor.world_size == 4 and executor.driver_rank == 2
        info = executor.collective_rpc("rank_info")
        assert [i["num_heads"] for i in info] == [4, 4, 4, 4]  # each stage's 8 heads over its 2 TP ranks
        assert llm.engine.batches.max_batches == 2
        _check_parity(llm, "tensor_parallel_size=2 x pipeline_parallel_size=2")
        # stage 0 ran a batch while stage 1 ran the one before, on four ranks (test_mp_batch_queue.py: TP=1)
        assert llm.engine.batches.peak_in_flight == 2 and llm.engine.executor.num_steps_in_flight == 0
    finally:
        llm.engine.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed")
def test_ray_pp2_greedy_parity():
    """The same stages as Ray actors: the last stage's first rank replies, two batches in flight."""
    llm = LLM(executor="ray", pipeline_parallel_size=2, executor_params={"num_cpus_per_worker": 0.5}, **PP_ENGINE)
    try:
        assert llm.engine.executor.driver_rank == 1 and llm.engine.executor.max_concurrent_batches == 2
        _check_parity(llm, "executor=ray pipeline_parallel_size=2")
        assert llm.engine.batches.peak_in_flight == 2 and llm.engine.executor.num_steps_in_flight == 0
    finally:
        llm.engine.shutdown()


def test_smollm2_layout_pp2_greedy_parity(tmp_path):
    """SmolLM2's layout at PP=2: 9 query / 3 KV heads and tied embeddings (the embedding on the first stage, the LM
    head on the last) in a tiny random-weight Llama of 4 layers, split evenly (2 + 2; stories260K's 5 split 3 + 2).
    SmolLM2's own weights keep their parity in ``tests/framework/engine/test_parity_smollm2.py``."""
    model = smollm2_layout_model(tmp_path / "smollm2_layout", num_hidden_layers=4, tie_word_embeddings=True)
    llm = LLM(model=model, executor="mp", pipeline_parallel_size=2, attention="torch", max_model_len=256,
              dtype="float32")
    try:
        assert [i["stage_layers"] for i in llm.engine.executor.collective_rpc(_stage_info)] == [(0, 2), (2, 4)]
        tok = llm.get_tokenizer()
        ids = [tok(p).input_ids for p in STORY_PROMPTS[:3]]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=12))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(model, ids, 12)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"executor": "uniproc"}, r"use executor=mp"),
    ({"pipeline_parallel_size": 6}, r"exceeds the model's 5 decoder layers"),
    ({"pp_layer_partition": "3,3"}, r"summing to the model's 5 layers"),
    ({"drafter": "ngram", "drafter_params": {"num_speculative_tokens": 3}}, r"spec_decode=ngram.*spec_decode=none"),
    ({"compile": "true"}, r"engine.compile=true"),
])
def test_refused_before_any_rank_starts(kwargs, match):
    shm_before, children_before = shm_snapshot(), set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=match):
        LLM(**{**PP_ENGINE, "executor": "mp", "pipeline_parallel_size": 2, **kwargs})
    assert set(multiprocessing.active_children()) <= children_before and new_shm_names(shm_before) == []


def test_killed_stage_fails_every_request_and_leaves_nothing():
    shm_before = shm_snapshot()
    llm = LLM(executor="mp", pipeline_parallel_size=2, **PP_ENGINE)
    pids = llm.engine.executor.worker_pids
    for i in range(3):
        llm.engine.add_request(str(i), STORY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=150,
                                                                        ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    os.kill(pids[0], signal.SIGKILL)  # the first stage: the last (the driver rank) waits on its hand-off
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 0") as info:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - t0 < 10
    assert sorted(o.request_id for o in info.value.outputs) == ["0", "1", "2"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in info.value.outputs)
    assert wait_for_nothing_left(shm_before, pids) == ([], []), "a stage process or a segment outlived the failure"
