"""Step features read from a SchedulerOutput: what decode, chunk, sampled rows and shared blocks count."""

from __future__ import annotations

from framework.core.outputs import SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.sim.features import StepFeatures, step_features


def _request(rid: str, prompt_len: int, computed: int, outputs: int = 0) -> Request:
    request = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=32))
    for t in range(outputs):
        request.append_output_token(100 + t)
    request.num_computed_tokens = computed
    return request


def test_decode_chunk_and_verify_rows():
    decode_a = _request("a", 40, computed=41, outputs=2)  # 42 tokens, 41 computed: one decode token
    decode_b = _request("b", 10, computed=10, outputs=1)  # shares its first block with a
    chunk = _request("c", 100, computed=32)  # a chunk of 48 that stops short of the prompt's end
    last_chunk = _request("d", 20, computed=0)  # the whole prompt: samples its first token
    verify = _request("e", 8, computed=8, outputs=1)  # 1 real token + 2 drafts
    so = SchedulerOutput(
        scheduled_requests=[decode_a, decode_b, chunk, last_chunk, verify],
        num_scheduled_tokens={"a": 1, "b": 1, "c": 48, "d": 20, "e": 3}, total_num_scheduled_tokens=73,
        block_ids={"a": ([7, 8, 9],), "b": ([7],), "c": ([1, 2, 3, 4, 5],), "d": ([6, 10],), "e": ([11],)},
        scheduled_spec_decode_tokens={"e": [50, 51]})
    f = step_features(so, block_size=16)
    assert (f.num_tokens, f.num_reqs, f.num_decode_reqs, f.num_prefill_reqs) == (73, 5, 2, 3)
    assert f.num_sampled == 1 + 1 + 1 + 3  # two decodes, the last chunk, the verify row's 2 drafts + 1
    assert f.decode_context == 42 + 11 and f.max_decode_context == 42
    assert f.decode_unique_context == 3 * 16  # block 7 read by both rows counts once
    assert f.prefill_context == (32 + 48) + 20 + (8 + 3)
    assert f.prefill_pairs == 48 * 32 + 48 * 49 // 2 + 20 * 21 // 2 + 3 * 8 + 3 * 4 // 2
    assert StepFeatures.from_dict(f.as_dict()) == f
