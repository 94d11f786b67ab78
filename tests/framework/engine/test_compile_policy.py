"""``engine.compile=auto|true|false``: the rule (no model), and how the engine applies it (stories260K, the
compile itself faked: ``tests/framework/worker/test_compile.py`` compiles for real the same way)."""

from __future__ import annotations

import logging

import pytest
from helpers import PREFIX_PROMPTS, STORY_PROMPTS

from framework import EngineConfig, SamplingParams
from framework.engine import compile_policy
from framework.engine.compile_policy import decide_compile


def test_rule():
    assert decide_compile("true", 0).compile and not decide_compile("false", 10**9).compile
    server = decide_compile("auto", None)
    assert server.compile and "server" in server.reason
    below = decide_compile("auto", 600, generated_tokens=300, break_even_tokens=1000)
    assert not below.compile and "900 output tokens" in below.reason and "engine.compile=true" in below.reason
    at = decide_compile("auto", 600, generated_tokens=400, break_even_tokens=1000)
    assert at.compile and "1,000 output tokens" in at.reason and "engine.compile=false" in at.reason


def test_default_threshold_is_read_at_call_time(monkeypatch):
    monkeypatch.setattr(compile_policy, "COMPILE_BREAK_EVEN_TOKENS", 50)
    assert decide_compile("auto", 50).compile and not decide_compile("auto", 49).compile
    assert "50" in compile_policy.startup_reason("auto")


@pytest.mark.parametrize(("value", "mode"), [(True, "true"), (False, "false"), ("auto", "auto"), ("false", "false")])
def test_config_normalizes_the_mode(value, mode):
    assert EngineConfig(model="m", compile=value).compile == mode


def test_config_refuses_other_modes():
    with pytest.raises(ValueError, match="compile must be auto, true or false"):
        EngineConfig(model="m", compile="sometimes")


@pytest.fixture
def fake_compiles(monkeypatch):
    """Record ``ModelRunner.compile_decoder`` calls (and whether the prefix cache was empty then)
    instead of compiling."""
    from framework.worker.model_runner import ModelRunner

    calls = []
    monkeypatch.setattr(ModelRunner, "compile_decoder", lambda runner: calls.append(runner))
    return calls


def test_auto_compiles_before_the_call_that_reaches_the_break_even(make_llm, monkeypatch, caplog):
    monkeypatch.setattr(compile_policy, "COMPILE_BREAK_EVEN_TOKENS", 40)
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm = make_llm()
    assert "engine.compile=auto: eager for now" in caplog.text
    cached_at_compile = []  # was any prefix still cached when the (faked) compile ran?
    monkeypatch.setattr(type(llm.engine.runner), "compile_decoder",
                        lambda runner: cached_at_compile.append(bool(llm.engine.kv_allocator._cached)))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm.generate(PREFIX_PROMPTS[:2], params)  # 16 planned
    assert not cached_at_compile and "eager, 16 output tokens" in caplog.text
    assert llm.engine.kv_allocator._cached  # the first call's prefixes are cached
    with caplog.at_level(logging.INFO, logger="framework.engine"):
        llm.generate(PREFIX_PROMPTS[2:5], params)  # 16 generated + 24 planned = 40
    assert cached_at_compile == [False]  # compiled once, after the prefix cache was dropped
    assert "compiling, 40 output tokens" in caplog.text
    summary = llm.engine.metrics.summary()
    assert summary["compile_mode"] == "auto" and "reach the break-even of 40" in summary["compile_reason"]


def test_auto_puts_the_compile_off_while_requests_hold_blocks(make_llm, fake_compiles, monkeypatch):
    monkeypatch.setattr(compile_policy, "COMPILE_BREAK_EVEN_TOKENS", 1)
    llm = make_llm()
    engine = llm.engine
    engine.add_request("busy", STORY_PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()  # the request now owns KV blocks
    decision = engine.maybe_compile(10)
    assert not decision.compile and "put off" in decision.reason and not fake_compiles
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.maybe_compile(10).compile and len(fake_compiles) == 1


def test_forced_modes_ignore_the_work(make_llm, fake_compiles):
    llm = make_llm(compile=False)
    assert not llm.engine.maybe_compile(None).compile and not fake_compiles
