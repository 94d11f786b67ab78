"""Every model family servelab runs (``framework/worker/model_families.py``) equals transformers.

Per family, a tiny random-weight model (``tests/families.py``: windows smaller than the context and
not a multiple of the block size, mixed layer types, softcaps that bend the scores, sinks, MoE,
MLA's value head size) runs one engine per backend with chunked prefill (16-token budget), prefix
caching (prompts share 12 tokens, 4-token blocks) and preemption (30 blocks for 4 requests of up to 53
tokens) forced: greedy tokens equal transformers' eager ``generate`` token for token and each step's
log-probabilities are within 1e-4. ``torch`` runs the reference (SDPA, explicit math for softcap
and sinks); ``torch_paged`` runs its in-place kernel for every token (decodes, chunks with cached
context, prefix hits) with prepacked oneDNN linears. Negative controls show the comparison catches a
backend that drops the window, the softcap or the sinks.
"""

from __future__ import annotations

import pytest
from families import FAMILY_IDS, hf_reference, prompts, tiny_config, tiny_model_dir

from framework import LLM, SamplingParams
from framework.worker.model_families import FAMILIES

MAX_TOKENS = 24
ENGINE = dict(block_size=4, max_num_batched_tokens=16, num_blocks=30, max_model_len=64, max_num_seqs=4,
              enable_prefix_caching=True, dtype="float32")
BACKENDS = {
    "torch": dict(attention="torch"),
    "torch_paged": dict(attention="torch_paged", prepack_linears="on",
                        attention_params={"compile": False, "min_paged_decodes": 1, "paged_prefill": True}),
}


def run_family(make_llm, family: str, **overrides) -> tuple[LLM, list]:
    """The family's tiny model under ``ENGINE`` (+ ``overrides``, through conftest's ``make_llm``, which
    checks every KV block is freed): the LLM and its greedy outputs (with logprobs) for :func:`prompts`."""
    llm = make_llm(model=str(tiny_model_dir(family)), **{**ENGINE, **overrides})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1))
    return llm, outs


def assert_matches_transformers(family: str, outs: list, what: str) -> None:
    """Greedy tokens equal transformers' and every returned log-probability is within 1e-4 of its."""
    for i, (out, (tokens, logprobs)) in enumerate(zip(outs, hf_reference(family, prompts(), MAX_TOKENS))):
        assert out.outputs[0].token_ids == tokens, f"{family} ({what}): prompt {i} diverged from transformers"
        for step, top in enumerate(out.outputs[0].logprobs):
            for token, value in top.items():
                assert abs(value - logprobs[step][token]) < 1e-4, \
                    f"{family} ({what}): prompt {i} step {step} logprob of {token} {value} != {logprobs[step][token]}"


def test_every_family_has_a_tiny_model_and_a_row():
    """The table ``servelab models`` prints and the tiny models cover the same families, and each tiny
    model's ``model_type`` is its row's."""
    assert sorted(f.test_id for f in FAMILIES) == sorted(FAMILY_IDS)
    for family in FAMILIES:
        assert tiny_config(family.test_id).model_type in family.model_types


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_family_parity(family, make_llm):
    for backend, overrides in BACKENDS.items():
        llm, outs = run_family(make_llm, family, **overrides)
        assert_matches_transformers(family, outs, backend)
        summary = llm.engine.metrics.summary()
        assert summary["num_preemptions"] > 0 and llm.engine.kv_allocator.stats().hit_rate > 0.2, summary
        assert summary["num_steps"] > MAX_TOKENS + 2  # prompts were chunked
