"""Hypothesis-generated requests through ``LLM`` (issue 34): sampling parameters, stop strings, logit biases and
structured-output specs (valid, invalid, unsatisfiable, huge), a few per batch next to a greedy control request.
Each is either refused with a ``ValueError`` naming the field, or runs and finishes; a request the engine fails is
a rejection (``internal_error`` false: e.g. its grammar does not compile), never a plugin fault; the control's
output never changes and no KV block leaks."""

from __future__ import annotations

import pytest
from fuzz_strategies import SAMPLING, STRUCTURED
from helpers import STORIES, assert_all_blocks_free
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framework import SamplingParams


@pytest.fixture(scope="module")
def llm():
    from framework import LLM

    return LLM(model=STORIES, max_model_len=64, num_blocks=64)


def test_fuzzed_requests_offline(llm):
    control_params = SamplingParams(temperature=0.0, max_tokens=8)
    control = llm.generate(["Once upon a time"], control_params)[0].outputs[0].token_ids
    structured = st.one_of(st.none(), st.none(), STRUCTURED)

    @settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(requests=st.lists(st.tuples(SAMPLING, structured), min_size=1, max_size=3))
    def check(requests):
        params = []
        for sampling, spec in requests:
            try:
                params.append(SamplingParams(**sampling, structured_outputs=spec))
            except ValueError:
                continue  # refused before anything is queued; the message names the field
        outs = llm.generate(["Once upon a time"] + ["Lily"] * len(params), [control_params] + params)
        assert outs[0].outputs[0].token_ids == control and outs[0].error is None
        for p, out in zip(params, outs[1:]):
            assert out.finished and not out.internal_error, (out.error, p, out.outputs[0].token_ids)
            assert out.outputs[0].finish_reason in (("abort",) if out.error else ("stop", "length"))
        assert_all_blocks_free(llm.engine)

    check()
