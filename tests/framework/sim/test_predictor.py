"""The step-time regression: it recovers a known cost model, predicts held-out grid points of the shipped
SmolLM2 CPU profile, and is cheap enough to call once per simulated step."""

from __future__ import annotations

import random
import time

import pytest

from framework.sim.features import StepFeatures
from framework.sim.predictor import BASIS, HELD_OUT_EVERY, LinearStepModel, basis, mean_relative_error
from framework.sim.profile import SHIPPED_DIR, StepProfile


def _random_features(rng: random.Random) -> StepFeatures:
    decode = rng.choice((0, 1, 3, 8, 20, 64, 150))
    ctx = [rng.randint(10, 2000) for _ in range(decode)]
    chunks = [rng.randint(2, 600) for _ in range(rng.choice((0, 0, 1, 3)))] if decode < 150 else []
    return StepFeatures(num_tokens=decode + sum(chunks), num_reqs=decode + len(chunks), num_decode_reqs=decode,
                        num_prefill_reqs=len(chunks), num_sampled=decode + len(chunks), decode_context=sum(ctx),
                        max_decode_context=max(ctx, default=0), decode_unique_context=sum(ctx) // 2,
                        prefill_context=sum(chunks), prefill_pairs=sum(q * (q + 1) // 2 for q in chunks))


def test_fit_recovers_a_known_cost_model():
    rng = random.Random(0)
    truth = dict.fromkeys(BASIS, 0.0) | {"const": 0.03, "decode_rows_over_4": 9e-4, "prefill_tokens": 6e-4,
                                         "decode_context": 2e-6, "prefill_pairs": 7e-7}
    coef = [truth[name] for name in BASIS]
    samples = []
    for _ in range(400):
        f = _random_features(rng)
        t = sum(a * b for a, b in zip(basis(f), coef)) * rng.uniform(0.97, 1.03)
        samples.append({**f.as_dict(), "step_s": t, "execute_s": 0.9 * t})
    model = LinearStepModel.fit(samples)
    assert model.held_out_mape < 0.03
    for name in ("const", "prefill_tokens", "prefill_pairs"):
        assert model.step_coef[BASIS.index(name)] == pytest.approx(truth[name], rel=0.1), name
    assert all(c >= 0 for c in model.step_coef)


def test_shipped_smollm2_profile_predicts_held_out_grid_points():
    (path,) = SHIPPED_DIR.glob("smollm2--cpu-*.json")
    profile = StepProfile.load(path)
    samples = profile.samples
    held = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    model = LinearStepModel.fit(train)
    assert mean_relative_error(model, held) < 0.12  # per step; measured 2-core timings scatter by ~5%
    for kind, keep in (("decode", lambda s: s["num_prefill_reqs"] == 0), ("with prefill", lambda s: s["num_prefill_reqs"])):
        part = [s for s in held if keep(s)]
        predicted = sum(model.predict(StepFeatures.from_dict(s)).step_s for s in part)
        assert predicted == pytest.approx(sum(s["step_s"] for s in part), rel=0.08), kind
    assert profile.key["device"].startswith("cpu:") and profile.key["compile"] is False
    assert LinearStepModel.from_dict(profile.predictor, profile.label).held_out_mape < 0.12


def test_a_prediction_costs_microseconds():
    model = LinearStepModel([1e-3] * len(BASIS), [1e-3] * len(BASIS))
    features = _random_features(random.Random(1))
    start = time.perf_counter()
    for _ in range(10_000):
        model.predict(features)
    assert time.perf_counter() - start < 0.5


def test_a_profile_of_another_basis_is_refused():
    with pytest.raises(ValueError, match="re-measure it"):
        LinearStepModel.from_dict({"kind": "linear", "basis": ["const"], "step_coef": [1.0], "execute_coef": [1.0]},
                                  "x")


def test_fitting_without_scikit_learn_names_the_sim_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "sklearn.linear_model", None)
    samples = [{**_random_features(random.Random(i)).as_dict(), "step_s": 0.05, "execute_s": 0.04} for i in range(80)]
    with pytest.raises(ImportError, match=r"servelab\[sim\]"):
        LinearStepModel.fit(samples)
