"""``executor=mp``: worker processes fed through the shared-memory broadcast, the model sharded over
them (tensor parallelism, float32; collectives through shared memory by default, gloo on request).

One module-scoped engine with two tensor-parallel ranks of stories260K (4 query / 2 KV heads each)
serves a run that mixes chunked prefill, prefix caching, swap preemption, n-gram speculative
decoding and a JSON-schema request: greedy tokens equal transformers'. EAGLE (on the driver) with
recompute preemption runs over two ranks too. SmolLM2's head layout (9 query / 3 KV heads, in a tiny model) is
refused at TP=2 before any worker starts and runs the same mixed workload at TP=3. Failures: a killed
worker fails every request within seconds and leaves no process or ``/dev/shm`` segment; a worker
that cannot load its weights shows its own error; SIGTERM and Ctrl-C leave nothing behind."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from executor_workload import ENGINE, MAX_TOKENS, check_every_feature_at_once, hf_grammar_greedy
from grammar_helpers import SCHEMA
from helpers import PREFIX_PROMPTS, REPO, STORIES, STORY_PROMPTS, hf_greedy, smollm2_layout_model

from framework import LLM, SamplingParams, StructuredOutputsParams
from framework.interfaces import EngineDeadError, WorkerError
from framework.testing.leftovers import new_shm_names, shm_snapshot, wait_for_nothing_left

pytestmark = pytest.mark.usefixtures("eager_paged_kernel")  # not about the attention kernel (tests/conftest.py)


def _gone(pids: list[int], shm_name: str | None, within_s: float = 10.0) -> bool:
    """Every pid has exited and the segment (if it had a name) is unlinked within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in _status(p)]
        if not alive and not (shm_name and (Path("/dev/shm") / shm_name).exists()):
            return True
        time.sleep(0.1)
    return False


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return "zombie"


@pytest.fixture(scope="module")
def mp_llm():
    llm = LLM(executor="mp", tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.shutdown()


def test_greedy_parity_with_every_feature_at_once(mp_llm):
    check_every_feature_at_once(mp_llm, "executor=mp")


def test_seeded_sampling_equals_uniproc(mp_llm):
    """Per-request generators, penalties and rejection sampling live on the driver rank's worker:
    the same draws as the same engine in-process."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, repetition_penalty=1.3)
              for i in range(3)]
    prompts = STORY_PROMPTS[:3]
    ours = [o.outputs[0].token_ids for o in mp_llm.generate(prompts, params)]
    ref = LLM(executor="uniproc", **ENGINE)
    assert ours == [o.outputs[0].token_ids for o in ref.generate(prompts, params)]


def test_collective_rpc_reaches_every_rank(mp_llm):
    executor = mp_llm.engine.executor
    # each rank's paged cache holds its 2 of the 4 KV heads: K and V, 5 layers, 8 slots, head 8, float32
    assert executor.collective_rpc("kv_cache_bytes_per_block") == [2 * 5 * 8 * 2 * 8 * 4] * 2
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # cores / tp by default
    info = executor.collective_rpc("rank_info")
    assert [(i["rank"], i["num_heads"], i["num_kv_heads"], i["num_local_ranks"], i["num_threads"]) for i in info] == [
        (rank, 4, 2, 2, threads) for rank in range(2)]
    full = sum(p.numel() * 4 for p in LLM(model=STORIES, attention="torch").engine.runner.model.parameters())
    assert all(0.45 * full < i["parameter_bytes"] < 0.55 * full for i in info)  # a shard each (norms replicated)
    # the two ranks share this host's RAM: each may take 90% of half of it
    import psutil

    assert 0.3 < executor.determine_available_memory() / psutil.virtual_memory().available < 0.5
    executor.check_health()
    with pytest.raises(WorkerError, match="rank 0 failed in no_such_method"):  # every rank failed: rank 0's
        executor.collective_rpc("no_such_method")
    executor.check_health()  # a failing call other than execute_model leaves the executor usable
    # and drains every rank's answer: the next call gets its own replies, not a stale error
    assert executor.collective_rpc("kv_cache_bytes_per_block") == [2 * 5 * 8 * 2 * 8 * 4] * 2
    with pytest.raises(AttributeError, match="worker processes"):
        _ = mp_llm.engine.runner


def test_gloo_collectives_give_the_same_tokens_as_shared_memory(mp_llm):
    """``parallel.communicator``: the default (``auto``) puts two CPU ranks of one host on the
    shared-memory collectives; ``torch_distributed`` (gloo) is the ablation and gives the same tokens."""
    assert [i["communicator"] for i in mp_llm.engine.executor.collective_rpc("rank_info")] == ["shm"] * 2
    llm = LLM(executor="mp", tensor_parallel_size=2, communicator="torch_distributed", model=STORIES,
              attention="torch", max_model_len=128, num_blocks=32, block_size=8)
    try:
        assert [i["communicator"] for i in llm.engine.executor.collective_rpc("rank_info")] == ["torch_distributed"] * 2
        tok = llm.get_tokenizer()
        ids = [tok(p).input_ids for p in STORY_PROMPTS[:3]]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(temperature=0.0, max_tokens=12))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, 12)
    finally:
        llm.engine.shutdown()
    with pytest.raises(ValueError, match="communicator=shm is for CPU ranks"):
        LLM(model=STORIES, device="cuda", tensor_parallel_size=2, communicator="shm")


def test_unloadable_weights_show_the_workers_error(tmp_path):
    bad = tmp_path / "stories-bad"
    shutil.copytree(STORIES, bad)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    shm_before = shm_snapshot()
    with pytest.raises(WorkerError, match=r"(?s)worker rank 0 failed to start:.*Traceback.*safetensors"):
        LLM(model=str(bad), executor="mp", attention="torch")
    assert new_shm_names(shm_before) == []  # a name another test's live process uses is not counted


def test_smollm2_head_layout_at_tp2_is_refused_before_any_worker_starts(nine_heads):
    """SmolLM2's 9 query / 3 KV heads at TP=2 (the tiny model of :func:`nine_heads`: the refusal reads only the
    config; SmolLM2's own config is ``test_tensor_parallel.py::test_smollm2_shape_refuses_tp2_naming_1_and_3``'s)."""
    shm_before, children_before = shm_snapshot(), set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"(?s)num_attention_heads=9.*valid tensor_parallel_size values.*\[1, 3\]"):
        LLM(model=nine_heads, executor="mp", tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) <= children_before and new_shm_names(shm_before) == []


SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = [{repo!r}]
    from framework import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model={model!r}, executor="mp", tensor_parallel_size={tp}, attention="torch", max_model_len=192,
                  compile=False)
        ex = llm.engine.executor
        print("READY", *ex.worker_pids, flush=True)
        while True:
            llm.generate(["Once upon a time"], SamplingParams(max_tokens=50, ignore_eos=True))
""")


@pytest.mark.parametrize(("sig", "tp", "whole_group"), [(signal.SIGTERM, 2, False), (signal.SIGINT, 1, False),
                                                        (signal.SIGKILL, 2, True)])
def test_signals_leave_no_worker_and_no_segment(tmp_path, sig, tp, whole_group):
    """SIGTERM / Ctrl-C of the driver, and a SIGKILL of its whole process group (the OOM killer, a container's
    stop: the resource tracker dies too): no process of the run is left, and no name it created is in /dev/shm
    (the folder compared before and after). Before, the group kill left each rank's ``sem.mp-*`` wake-up."""
    script = tmp_path / "serve_forever.py"
    script.write_text(SCRIPT.format(repo=str(REPO), model=STORIES, tp=tp))
    stderr = open(tmp_path / "stderr.log", "w+")  # noqa: SIM115 - closed below
    before = shm_snapshot()
    # SIGINT's default disposition in the child: a suite started as a background job of a non-interactive shell
    # (`cmd &`) inherits SIGINT ignored, the child too, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(script)], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, cwd=tmp_path, start_new_session=whole_group,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        import psutil

        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]  # ranks, resource tracker
        time.sleep(0.5)
        if whole_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGABRT)  # faulthandler prints every thread's stack
            proc.wait(10)
            stderr.seek(0)
            pytest.fail(f"no exit 30 s after {sig!r}:\n{stderr.read()[-6000:]}")
        assert wait_for_nothing_left(before, pids) == ([], [])
    finally:
        proc.kill()
        stderr.close()


@pytest.mark.slow
def test_eagle_on_a_compiled_target_over_two_ranks_with_recompute_preemption():
    """``engine.compile=true`` at TP=2: each rank compiles its shard's decoder layer once for all 5 layers
    (one layer kind: the sharded projections' ``Shard`` is a value, equal on every layer) with the
    shared-memory collectives inside the graph (``fullgraph``; traced ``torch_paged`` attention), both
    stay compiled and compile nothing after the warm-up. EAGLE's head runs in the driver on the target's embedding
    and LM head loaded there (whole); rank 0 ships the target's hidden states (whole on every rank,
    from the compiled decoder) back with each output. 12 blocks of 8 tokens cannot hold the four
    requests at once: recompute preemption. Greedy tokens equal transformers'."""
    from helpers import STORIES_EAGLE

    llm = LLM(model=STORIES, executor="mp", tensor_parallel_size=2, max_model_len=96,  # default torch_paged
              block_size=8, num_blocks=12, drafter="eagle", compile=True,
              drafter_params={"model": STORIES_EAGLE, "num_speculative_tokens": 3})
    try:
        warm = llm.engine.executor.collective_rpc("compile_stats")
        assert all(s.active and s.fallback_reason is None and s.num_layer_kinds == 1 for s in warm), warm
        assert [s.num_graphs_warmup for s in warm] == [3, 3], warm  # prefill, 1-token, traced decode
        tok = llm.get_tokenizer()
        ids = [tok(p).input_ids for p in STORY_PROMPTS[:4]]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(STORIES, ids, MAX_TOKENS)
        summary = llm.engine.metrics.summary()
        assert summary["spec_num_accepted_tokens"] > 0 and summary["num_preemptions_recompute"] > 0
        assert [s.num_graphs for s in llm.engine.executor.collective_rpc("compile_stats")] == [
            s.num_graphs for s in warm]  # the warm-up covered every step shape
    finally:
        llm.engine.shutdown()


def test_cuda_needs_one_gpu_per_rank(monkeypatch):
    from framework.config import EngineConfig
    from plugins.executors.mp import MultiprocExecutor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    problems = MultiprocExecutor.validate(EngineConfig(model=STORIES, device="cuda", tensor_parallel_size=2))
    assert problems == ["tensor_parallel_size=2 needs 2 GPUs (one per rank), 1 visible; lower it or use executor=ray "
                        "across nodes"]
    (problem,) = MultiprocExecutor.validate(EngineConfig(model=STORIES, device="cuda:1", tensor_parallel_size=2))
    assert "use device=cuda (rank r runs on cuda:r" in problem
    assert MultiprocExecutor.validate(EngineConfig(model=STORIES, device="cuda", tensor_parallel_size=1)) == []


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory) -> str:
    """SmolLM2's head layout (9 query / 3 KV heads: TP=1 or 3) in a tiny random-weight Llama
    (``helpers.smollm2_layout_model``). SmolLM2's own weights at TP=3 are
    ``tests/framework/model_executor/test_tensor_parallel.py::test_smollm2_tp3_matches_tp1``'s."""
    return smollm2_layout_model(tmp_path_factory.mktemp("nine_heads"))


def test_nine_heads_over_three_ranks_greedy_parity_with_every_feature_at_once(nine_heads):
    """9 query / 3 KV heads over 3 ranks (3 / 1 each), three processes on two cores: chunked prefill,
    prefix caching, swap preemption, n-gram drafts and a JSON request, token for token with
    transformers (float32)."""
    llm = LLM(executor="mp", tensor_parallel_size=3, **{**ENGINE, "model": nine_heads, "dtype": "float32"})
    try:
        tok = llm.get_tokenizer()
        ids = [tok(p).input_ids for p in PREFIX_PROMPTS[:3] + STORY_PROMPTS[:3]]
        json_ids = tok("Tom wrote his name and age:").input_ids
        so = StructuredOutputsParams(json=SCHEMA)
        outs = llm.generate([{"prompt_token_ids": i} for i in ids + [json_ids]],
                            [SamplingParams(temperature=0.0, max_tokens=16)] * len(ids)
                            + [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)])
        assert [o.outputs[0].token_ids for o in outs[:-1]] == hf_greedy(nine_heads, ids, 16)
        summary = llm.engine.metrics.summary()
        assert summary["num_preemptions_swap"] > 0 and summary["prefix_cache_hit_rate"] > 0
        assert summary["spec_num_accepted_tokens"] > 0
        # K and V, 3 layers, 8 slots, one KV head of 8 per rank, float32
        assert llm.engine.executor.collective_rpc("kv_cache_bytes_per_block") == [2 * 3 * 8 * 1 * 8 * 4] * 3
        assert outs[-1].outputs[0].token_ids == hf_grammar_greedy(llm, nine_heads, json_ids, so, 24)
    finally:
        llm.engine.shutdown()


def test_killed_worker_fails_every_request_within_seconds(mp_llm):
    """Kills the module's engine: keep this test last in the module."""
    llm = mp_llm
    executor = llm.engine.executor
    pids, shm = executor.worker_pids, executor.shm_name
    for i in range(4):
        llm.engine.add_request(str(i), STORY_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=150,
                                                                        ignore_eos=True))
    for _ in range(3):
        llm.engine.step()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1") as info:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - t0 < 10
    assert sorted(o.request_id for o in info.value.outputs) == ["0", "1", "2", "3"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" and "rank 1" in o.error
               for o in info.value.outputs)
    assert _gone(pids, shm), "a worker process or the shared-memory segment outlived the failure"
    with pytest.raises(EngineDeadError):
        llm.generate(["Lily"])


def test_a_step_error_names_the_rank_that_died_first():
    """A stage SIGKILLed mid-step resets its peer's gloo connection a moment before its own exit is visible: the
    peer's "connection reset" arrives first, and the executor still names the dead rank as the cause."""
    from plugins.executors.mp import MultiprocExecutor

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    alive = iter([True, True, False, False])  # the dead rank shows up on the third look
    executor._all_alive = lambda: next(alive)
    executor._dead_rank = lambda: "worker rank 0 (pid 7) exited with code -9"
    reason = executor._root_cause("worker rank 1 failed in execute_model (Connection reset by peer)")
    assert reason.startswith("worker rank 0 (pid 7) exited with code -9; then worker rank 1 failed")
    executor._all_alive = lambda: True  # a rank's own error, every process alive: reported as it is, after the grace
    assert executor._root_cause("worker rank 1 failed in execute_model (ValueError)", grace_s=0.05).startswith(
        "worker rank 1 failed")
