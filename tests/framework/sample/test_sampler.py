"""Sampler tests: greedy, seeded reproducibility, sampling statistics, filters, min_tokens,
penalties and logprobs. CPU only, no model."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.sample.sampler import (
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

EOS = 2
_ids = itertools.count()


def make_request(prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Request:
    """A request with EOS id 2; ``params`` go to ``SamplingParams``."""
    params.setdefault("max_tokens", 64)
    return Request(request_id=f"r{next(_ids)}", prompt_token_ids=prompt or [0, 1],
                   output_token_ids=list(output or []), sampling_params=SamplingParams(**params),
                   eos_token_ids=frozenset({EOS}))


def probs_logits(probs: list[float]) -> torch.Tensor:
    """(1, len(probs)) float32 logits whose softmax is ``probs``."""
    return torch.tensor([probs], dtype=torch.float32).log()


def sample_support(logits_row: torch.Tensor, n: int = 2000, seed: int = 0, **params) -> torch.Tensor:
    """Sample ``n`` rows with the same logits and params in one call; returns the (vocab,) counts."""
    requests = [make_request(**params) for _ in range(n)]
    out = Sampler(logits_row.shape[-1], seed=seed)(logits_row.reshape(1, -1).expand(n, -1), requests)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[-1])


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler(50)(logits, [make_request(temperature=0.0) for _ in range(6)])
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(dim=1).tolist()
    assert out.logprobs is None


def test_greedy_accepts_bf16_and_padded_vocab() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    logits[:, 32:] = 100.0  # padded columns past vocab_size must never be sampled
    out = Sampler(32)(logits.to(torch.bfloat16), [make_request(temperature=0.0) for _ in range(3)])
    assert out.token_ids == logits[:, :32].to(torch.bfloat16).float().argmax(dim=1).tolist()


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    out = Sampler(100)(logits, [make_request(temperature=1.0, top_k=1) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    requests = [make_request(temperature=0.0), make_request(), make_request(temperature=0.0), make_request()]
    out = Sampler(30)(logits, requests)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == logits[2].argmax().item()
    assert all(0 <= t < 30 for t in out.token_ids)


def test_seeded_rows_reproducible_and_batch_independent() -> None:
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 0.1  # near-flat
    alone = make_request(seed=7)
    batched = make_request(seed=7)
    others = [make_request(), make_request(seed=3), make_request(temperature=0.0)]
    alone_tokens, batched_tokens = [], []
    for step in range(5):
        alone_tokens.append(Sampler(vocab, seed=step)(logits[1:2], [alone]).token_ids[0])
        batch = [others[0], batched, others[1], others[2]]
        batch_logits = torch.cat([logits[0:1], logits[1:2], logits[2:4]])
        batched_tokens.append(Sampler(vocab, seed=100 + step)(batch_logits, batch).token_ids[1])
    assert alone_tokens == batched_tokens
    assert len(set(alone_tokens)) > 1  # the generator advances between calls


def test_engine_seed_reproducible() -> None:
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(6))
    first = Sampler(200, seed=11)(logits, [make_request() for _ in range(16)]).token_ids
    second = Sampler(200, seed=11)(logits, [make_request() for _ in range(16)]).token_ids
    other = Sampler(200, seed=12)(logits, [make_request() for _ in range(16)]).token_ids
    assert first == second
    assert first != other


def test_temperature_1_frequencies_match_softmax() -> None:
    probs = [0.4, 0.25, 0.2, 0.1, 0.05]
    n = 4000
    counts = sample_support(probs_logits(probs)[0], n=n, seed=123).double()
    expected = torch.tensor(probs, dtype=torch.float64) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # chi-square, 4 dof: P(chi2 > 20.5) ~ 4e-4


def test_temperature_sharpens_distribution() -> None:
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])[0]
    cold = sample_support(logits, n=2000, temperature=0.25)
    hot = sample_support(logits, n=2000, temperature=1.0)
    assert cold[0] > hot[0] + 300


def test_top_k_restricts_support() -> None:
    logits = probs_logits([0.1, 0.3, 0.05, 0.25, 0.2, 0.1])[0]
    counts = sample_support(logits, top_k=3)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3, 4}


def test_top_p_restricts_to_nucleus() -> None:
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])[0]
    counts = sample_support(logits, top_p=0.7)  # 0.5 then 0.3 reaches 0.7
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 3}
    counts = sample_support(logits, top_p=0.45)  # the top token alone
    assert set(torch.nonzero(counts).flatten().tolist()) == {1}


def test_top_k_top_p_helper_per_row() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05]).expand(3, -1)
    out = apply_top_k_top_p(logits, torch.tensor([2, 4, 4]), torch.tensor([1.0, 0.9, 1.0]))
    finite = torch.isfinite(out)
    assert finite.tolist() == [[True, True, False, False], [True, True, True, False], [True] * 4]
    assert torch.equal(out[finite], logits[finite])


def test_min_p_drops_low_prob_tokens() -> None:
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    out = apply_min_p(logits, torch.tensor([0.2]))  # threshold 0.1
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]
    counts = sample_support(logits[0], min_p=0.2)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 1, 2}


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 7.0]]).expand(4, -1)
    requests = [
        make_request(temperature=0.0, min_tokens=2, stop_token_ids=[5]),  # too short: EOS and 5 masked
        make_request(output=[4, 4], temperature=0.0, min_tokens=2, stop_token_ids=[5]),  # long enough
        make_request(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True),  # EOS allowed
        make_request(temperature=0.0, min_tokens=2, stop_token_ids=[5, 99]),  # out-of-vocab id ignored
    ]
    assert Sampler(7)(logits, requests).token_ids == [6, EOS, EOS, 6]


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    out = apply_penalties(logits, [[0], [0]], [[1, 3, 3], [1, 3, 3]],
                          repetition_penalties=torch.tensor([2.0, 1.0]),
                          presence_penalties=torch.tensor([0.5, 0.0]),
                          frequency_penalties=torch.tensor([0.25, 0.0]))
    # row 0: token 0 (prompt) only repetition: 2/2; token 1: -1*2 - 0.25*1 - 0.5;
    # token 2 unseen; token 3: 3/2 - 0.25*2 - 0.5
    assert out.tolist() == [[1.0, -2.75, 0.5, 0.5], [2.0, -1.0, 0.5, 3.0]]
    assert logits.tolist()[0] == [2.0, -1.0, 0.5, 3.0]  # input untouched


def test_presence_and_frequency_ignore_prompt() -> None:
    logits = torch.zeros(1, 3)
    out = apply_penalties(logits, [[0, 0, 1]], [[1, 1]], torch.tensor([1.0]), torch.tensor([1.0]),
                          torch.tensor([0.5]))
    assert out.tolist() == [[0.0, -2.0, 0.0]]


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]])
    plain = Sampler(4)(logits, [make_request(prompt=[1], temperature=0.0)]).token_ids
    penalized = Sampler(4)(logits, [make_request(prompt=[1], temperature=0.0, repetition_penalty=2.0)]).token_ids
    assert (plain, penalized) == ([1], [2])


def test_logprobs_are_raw_top_n_plus_sampled() -> None:
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(8)) * 3
    requests = [make_request(logprobs=3, temperature=0.7, repetition_penalty=1.5),
                make_request(), make_request(logprobs=0, temperature=0.0)]
    out = Sampler(10)(logits, requests)
    raw = logits.log_softmax(dim=1)
    top3 = raw[0].topk(3).indices.tolist()
    assert set(out.logprobs[0]) == set(top3) | {out.token_ids[0]}
    for row in (0, 2):
        for token, lp in out.logprobs[row].items():
            assert lp == pytest.approx(raw[row, token].item(), abs=1e-5)
    assert out.logprobs[1] == {}
    assert list(out.logprobs[2]) == [out.token_ids[2]]


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="num_reqs=2"):
        Sampler(10)(torch.zeros(3, 10), [make_request(), make_request()])
    assert Sampler(10)(torch.zeros(0, 10), []).token_ids == []


@pytest.mark.gpu
def test_seeded_cuda_matches_cpu() -> None:
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(9))
    cpu = Sampler(500)(logits, [make_request(seed=s) for s in (1, 2, 3)]).token_ids
    gpu = Sampler(500)(logits.cuda(), [make_request(seed=s) for s in (1, 2, 3)]).token_ids
    assert cpu == gpu


def test_greedy_argmax_chunked_bf16_matches_float32_with_ties() -> None:
    from framework.sample.sampler import GREEDY_ROWS_PER_CHUNK, greedy_argmax

    logits = torch.randn(3 * GREEDY_ROWS_PER_CHUNK + 5, 64).to(torch.bfloat16)
    logits[:, 40] = logits[:, 7] = 100.0  # tie: the first index wins, as in float32 argmax
    assert greedy_argmax(logits) == [7] * logits.shape[0]
    logits = torch.randn(3 * GREEDY_ROWS_PER_CHUNK + 5, 64).to(torch.bfloat16)
    assert greedy_argmax(logits) == logits.float().argmax(dim=1).tolist()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), vocab=st.sampled_from([8, 63, 64, 65, 200, 256, 1000]),
       block=st.sampled_from([8, 16, 64]), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       special=st.sampled_from(["none", "ties", "nan", "neg_inf"]), seed=st.integers(0, 2**16))
def test_greedy_argmax_two_stage_is_first_index_of_maximum(rows: int, vocab: int, block: int, dtype: torch.dtype,
                                                           special: str, seed: int) -> None:
    """The two-stage (block maxima, then inside the first maximal block) argmax returns exactly what
    ``argmax`` of the float32 copy returns: first index on ties (also across blocks and into the
    ``-inf`` padding of a partial last block), NaN as the maximum, all ``-inf`` rows -> 0."""
    import framework.sample.sampler as sampler_module

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    cols = torch.randint(0, vocab, (rows, 3), generator=gen)
    if special == "ties":  # the maximum at up to 3 columns, often in different blocks
        logits.scatter_(1, cols, 50.0)
    elif special == "nan":
        logits[::2].scatter_(1, cols[::2, :1], float("nan"))
    elif special == "neg_inf":
        logits[::3] = float("-inf")
    saved = sampler_module.GREEDY_COLUMNS_PER_BLOCK
    sampler_module.GREEDY_COLUMNS_PER_BLOCK = block
    try:
        got = sampler_module.greedy_argmax(logits)
    finally:
        sampler_module.GREEDY_COLUMNS_PER_BLOCK = saved
    assert got == logits.float().argmax(dim=1).tolist()


# ---- found by the request fuzzer (issue 34) ------------------------------------------------------------------
def test_logit_bias_forces_and_forbids_tokens() -> None:
    """OpenAI's logit_bias: +100 makes a token win even against a strong logit, -100 removes the argmax; on the
    greedy fast path and the sampling path alike; a row without bias is untouched."""
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 3)
    reqs = [make_request(temperature=0.0, logit_bias={3: 100.0}), make_request(temperature=0.0, logit_bias={0: -100.0}),
            make_request(temperature=0.0)]
    assert Sampler(4)(logits, reqs).token_ids == [3, 1, 0]
    counts = sample_support(torch.tensor([5.0, 1.0, 0.0, -1.0]), n=300, logit_bias={0: -100.0, 2: 100.0})
    assert counts[2] == 300


def test_extreme_but_valid_parameters_sample_allowed_tokens() -> None:
    """A repetition penalty at float32's smallest normal overflows positive logits to +inf (inf - inf is NaN in the
    softmax, and argmax of NaNs always took the first); capped, the two seen tokens tie and both are sampled, masked
    ones never. A temperature below SAMPLING_EPS is greedy (dividing by it overflows)."""
    row = torch.tensor([5.0, 4.0, float("-inf"), float("-inf")])
    counts = sample_support(row, n=400, prompt=[0, 1], temperature=1.0, repetition_penalty=1.2e-38)
    assert counts[0] > 100 and counts[1] > 100 and counts[2:].sum() == 0
    assert make_request(temperature=1e-7).sampling_params.greedy
    assert Sampler(4)(row[None], [make_request(temperature=1e-7)]).token_ids == [0]
    # a top_p that is 0 in float32 once dropped the top token too: an all -inf row sampled the masked token 0
    masked = torch.tensor([float("-inf"), 1.0, 3.0, float("-inf")])
    assert sample_support(masked, n=50, temperature=1.0, top_p=1e-300)[2] == 50


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": 1e300}, "temperature"), ({"repetition_penalty": 1e-203}, "repetition_penalty"),
    ({"top_p": float("nan")}, "top_p"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"logit_bias": {3: float("inf")}}, "logit_bias"),
    ({"seed": 2**64}, "seed"),
])
def test_float32_overflowing_parameters_are_refused(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_inverse_cdf_sample_follows_the_weights_and_never_picks_a_zero():
    from framework.sample.sampler import inverse_cdf_sample

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    edges = torch.tensor([0.0, 0.4999, 0.5, 0.7999, 0.8, 0.999999], dtype=torch.float64)
    picked = inverse_cdf_sample(probs.expand(len(edges), -1), edges).tolist()
    assert picked == [1, 1, 3, 3, 4, 4]  # interval boundaries; ids of weight 0 never come out
    g = torch.Generator().manual_seed(0)
    n = 40_000
    draws = inverse_cdf_sample(probs.expand(n, -1), torch.rand(n, dtype=torch.float64, generator=g))
    freq = torch.bincount(draws, minlength=6).double() / n
    assert torch.allclose(freq, probs[0].double(), atol=0.01), freq  # 4-sigma at n = 40k is ~0.01
    assert inverse_cdf_sample(torch.tensor([[2.0, 6.0]]), torch.tensor([0.3], dtype=torch.float64)).item() == 1
