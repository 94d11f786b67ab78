"""The executor plugin kind: a third-party executor registered through ``register_executors`` runs the
engine in ``build_engine``'s call order; a lost worker fails every in-flight request and the engine;
``executor=auto`` resolves by rank count; bad choices are refused before any weights load."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import STORIES

from framework import LLM, EngineConfig, SamplingParams, hookimpl, registry
from framework.engine.builder import validate_plugins
from framework.interfaces import EngineDeadError
from plugins.executors.uniproc import UniProcExecutor


class RecordingExecutor(UniProcExecutor):
    """``uniproc`` that records every call and can lose its worker after ``die_after`` steps."""

    name = "recording"

    def __init__(self, config: EngineConfig, die_after: int = -1, **params) -> None:
        self.calls: list[str] = []
        self.die_after = die_after
        super().__init__(config, **params)

    def collective_rpc(self, method, args=(), kwargs=None, timeout_s=None, unique_reply_rank=None):
        self.calls.append(method)
        if method == "execute_model" and self.calls.count(method) == self.die_after:
            raise self._fail(EngineDeadError("worker rank 0 vanished (simulated)"))
        return super().collective_rpc(method, args, kwargs, timeout_s, unique_reply_rank)

    def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead


class _Plugin:
    @hookimpl
    def register_executors(self, register):
        register("recording", RecordingExecutor)


@pytest.fixture
def recording():
    with registry.registered(_Plugin()):
        yield


def test_registered_executor_runs_the_engine_in_call_order(recording):
    llm = LLM(model=STORIES, executor="recording", attention="torch", grammar="none")
    executor = llm.engine.executor
    assert executor.driver_model() is llm.engine.runner.model  # in-process: drafters share the model itself
    outs = llm.generate(["Once upon a time", "Lily"], SamplingParams(temperature=0.0, max_tokens=8))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    calls = executor.calls
    first_step = calls.index("execute_model")
    assert calls[:first_step] == ["kv_cache_bytes_per_block", "determine_available_memory", "initialize_cache",
                                  "kv_cache_bytes_per_block", "compile_stats", "kv_cache_bytes_per_block",
                                  "compile_stats"]
    assert set(calls[first_step:]) == {"execute_model"}
    assert executor.determine_available_memory() == llm.config.kv_cache_memory_bytes
    assert executor.kv_cache_bytes_per_block() == llm.engine.runner.block_bytes


def test_a_lost_worker_fails_every_request_and_the_engine(recording):
    llm = LLM(model=STORIES, executor="recording", executor_params={"die_after": 3}, attention="torch")
    lost: list[EngineDeadError] = []
    llm.engine.executor.register_failure_callback(lost.append)
    finished = []

    class Observer:
        @hookimpl
        def on_request_finished(self, output):
            finished.append(output)

    for i in range(3):
        llm.engine.add_request(str(i), "Once upon a time", SamplingParams(temperature=0.0, max_tokens=20))
    with registry.registered(Observer()), pytest.raises(EngineDeadError, match="vanished") as info:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert len(lost) == 1 and lost[0] is info.value
    assert sorted(o.request_id for o in info.value.outputs) == ["0", "1", "2"]
    assert all(o.finished and o.error and "vanished" in o.error for o in info.value.outputs)
    assert sorted(o.request_id for o in finished) == ["0", "1", "2"]
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        llm.engine.check_health()
    with pytest.raises(EngineDeadError):  # a dead engine refuses new work
        llm.engine.add_request("3", "Lily")
    with pytest.raises(EngineDeadError):  # and LLM.generate raises at once
        llm.generate(["Lily"])


def test_auto_resolves_by_rank_count_and_uniproc_refuses_two_ranks():
    assert EngineConfig(model=STORIES).executor == "uniproc"
    assert EngineConfig(model=STORIES, tensor_parallel_size=2).executor == "mp"
    # CPU data-parallel replicas in one process: their ranks in worker processes (they compute at once); a server's
    # engine-core process (one replica) resolves auto again for itself; CUDA replicas stay in-process
    front = EngineConfig(model=STORIES, data_parallel_size=2)
    assert front.executor == "mp" and EngineConfig(model=STORIES, data_parallel_size=2, device="cuda").executor == "uniproc"
    assert dataclasses.replace(front, data_parallel_size=1, executor="auto").executor == "uniproc"
    with pytest.raises(ValueError, match="executor=uniproc runs one rank"):
        validate_plugins(EngineConfig(model=STORIES, executor="uniproc", tensor_parallel_size=2))
    with pytest.raises(registry.UnknownPluginError, match=r"mp, (ray, )?sim, uniproc"):
        validate_plugins(EngineConfig(model=STORIES, executor="nope"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model=STORIES, tensor_parallel_size=0)


def test_mp_refuses_a_plugin_registered_only_in_this_process():
    from framework.interfaces import AttentionBackend

    class Local(AttentionBackend):
        name = "local_attention"

    class _Local:
        @hookimpl
        def register_attention_backends(self, register):
            register("local_attention", Local)

    with registry.registered(_Local()):
        with pytest.raises(ValueError, match="registered only in this process"):
            validate_plugins(EngineConfig(model=STORIES, executor="mp", attention="local_attention"))


def test_embeddings_alone_match_the_model():
    """What an EAGLE drafter on the driver gets when the target lives in worker processes."""
    import torch

    from framework.model_executor.embeddings import load_embeddings
    from framework.model_executor.model_loader import load_model

    full, emb = load_model(STORIES).model, load_embeddings(STORIES)
    assert emb.get_output_embeddings().weight is emb.get_input_embeddings().weight  # stories260K ties them
    assert torch.equal(emb.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert torch.equal(emb.get_output_embeddings().weight, full.get_output_embeddings().weight)


def test_workers_drop_aborted_requests_and_a_reused_id_starts_fresh():
    """Finished ids reach the workers even on a step that schedules nothing, so a request id used
    again later is a new request to them (its mirror is not the old one's)."""
    from helpers import hf_greedy

    llm = LLM(model=STORIES, attention="torch", grammar="none")
    engine, tok = llm.engine, llm.get_tokenizer()
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    engine.abort_request("a")
    engine.step()  # nothing to schedule: the message only carries "a" as finished
    assert "a" not in engine.runner.input_batch.requests
    ids = tok("The dog ran to the park and").input_ids
    engine.add_request("a", ids, SamplingParams(temperature=0.0, max_tokens=12))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == hf_greedy(STORIES, [ids], 12)[0]


def test_parallel_section_and_executor_group_compose():
    from helpers import REPO
    from hydra import compose, initialize_config_dir

    from framework.entrypoints.hydra_config import engine_config_from_cfg, register_config_nodes

    register_config_nodes()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["parallel.tensor_parallel_size=2", "parallel.num_threads_per_rank=1"])
        config = engine_config_from_cfg(cfg)
        assert (config.executor, config.tensor_parallel_size, config.num_threads_per_rank) == ("mp", 2, 1)
        assert engine_config_from_cfg(compose(config_name="config")).executor == "uniproc"
        ray_cfg = engine_config_from_cfg(compose(config_name="config", overrides=["executor=ray"]))
        assert ray_cfg.executor == "ray" and ray_cfg.executor_params["placement_strategy"] == "PACK"
        with pytest.raises(ValueError, match="unknown parallel keys"):
            engine_config_from_cfg(compose(config_name="config", overrides=["+parallel.context_parallel_size=2"]))
