"""Bad input gets a clear error naming the fix, before the model loads where possible, and never
corrupts engine state or loses other requests."""

from __future__ import annotations

import pytest
from helpers import STORIES

from framework import LLM, SamplingParams, hookimpl, registry
from framework.interfaces import AttentionBackend

MISSING_MODEL = "/nonexistent/model/folder"  # any load attempt would raise FileNotFoundError


def test_unknown_plugin_fails_before_model_load():
    with pytest.raises(registry.UnknownPluginError, match="valid choices: .*fcfs, .*priority"):
        LLM(model=MISSING_MODEL, scheduler="nope")
    with pytest.raises(registry.UnknownPluginError, match="torch"):
        LLM(model=MISSING_MODEL, attention="flashnope")


class _CudaOnlyBackend(AttentionBackend):
    """Throwaway backend that declares it needs CUDA."""

    name = "cuda_only"
    requires_cuda = True

    def build_metadata(self, common):  # pragma: no cover - never reached on CPU
        raise AssertionError("kernel must not run")

    def forward(self, *args):  # pragma: no cover
        raise AssertionError("kernel must not run")


class _CudaOnlyPlugin:
    @hookimpl
    def register_attention_backends(self, register):
        register("cuda_only", _CudaOnlyBackend)


def test_capability_check_before_model_load():
    import torch

    if torch.cuda.is_available():
        pytest.skip("machine has CUDA: the capability check passes")
    with registry.registered(_CudaOnlyPlugin()):
        with pytest.raises(ValueError, match="needs a CUDA GPU.*attention=torch"):
            LLM(model=MISSING_MODEL, dtype="float32", attention="cuda_only")  # auto would read config.json


def test_kv_budget_too_small_for_one_request():
    with pytest.raises(ValueError, match="fewer than one max_model_len=512 request"):
        LLM(model=STORIES, num_blocks=4, block_size=16)


def test_max_model_len_above_model_limit():
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        LLM(model=STORIES, max_model_len=1024)


def test_prompt_too_long_rejected_others_finish(make_llm):
    llm = make_llm(max_model_len=32)
    long_prompt = "Once upon a time " * 20
    outs = llm.generate(["Once upon a time", long_prompt, "The dog"], SamplingParams(temperature=0, max_tokens=8))
    assert outs[1].error and "max_model_len is 32" in outs[1].error and outs[1].outputs[0].finish_reason == "abort"
    for i in (0, 2):
        assert outs[i].error is None and len(outs[i].outputs[0].token_ids) >= 1
        assert outs[i].outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2.0}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_sampling_params_queue_nothing(make_llm):
    llm = make_llm()
    bad = SamplingParams()
    bad.temperature = -2.0  # mutated after construction
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["a", "b"], [SamplingParams(), bad])
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Once", SamplingParams(max_tokens=4))[0].outputs[0].token_ids


def test_engine_add_request_errors_leave_state_clean(make_llm):
    engine = make_llm(max_model_len=16).engine
    engine.add_request("a", [1, 5, 6], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 5], SamplingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match=r"\[0, 512\)"):
        engine.add_request("c", [1, 9999], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len is 16"):
        engine.add_request("d", list(range(3, 30)), SamplingParams())
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["a"] and len(finished[0].outputs[0].token_ids) == 4


def test_abort_running_and_waiting(make_llm):
    engine = make_llm(max_num_seqs=1).engine
    engine.add_request("run", [1, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("wait", [1, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("keep", [1, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.abort_request(["run", "wait", "unknown"])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["keep"]


def test_drafter_bad_num_speculative_tokens_before_weights_load():
    """A third-party drafter gets the base checks; the error names the fix and comes before loading."""
    class _Drafter(registry.KINDS["drafter"][1]):
        name = "dummy_drafter"

        def propose(self, requests):  # pragma: no cover
            return {}

    class _Plugin:
        @hookimpl
        def register_drafters(self, register):
            register("dummy_drafter", _Drafter)

    with registry.registered(_Plugin()):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            LLM(model=MISSING_MODEL, dtype="float32", drafter="dummy_drafter", drafter_params={"num_speculative_tokens": 0})
