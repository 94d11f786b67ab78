"""Step-time predictors: how long one engine step takes, from its :class:`~framework.sim.features.StepFeatures`.

Three kinds, one interface (:class:`StepTimePredictor`):

* :class:`LinearStepModel` — a regression fit on a measured profile (``servelab profile``). Its inputs
  are roofline-shaped features of the step (Williams et al., "Roofline", CACM 2009): a fixed per-step
  cost (the weights streamed once per forward, the Python of every layer); decode rows, with hinges at
  4/16/64 rows so the fit can follow the bend from weight-streaming (time flat in rows) to compute-bound
  GEMMs; prefill tokens, capped copies at 128 and 512 tokens so a small chunk may cost more per token
  (GEMMs of few rows run further from peak), and chunks (per-chunk attention calls); sampled rows of
  chunks (LM head, sampler); decode keys read, all and distinct (bandwidth-bound attention: rows sharing a
  cached prefix read its blocks from the same memory); for decode batches under
  :data:`SMALL_DECODE_BATCH` rows, rows x the longest row's keys, since the default CPU backend,
  ``torch_paged``, sends those through a padded gather + SDPA path at ~10x the cost per key; chunk keys gathered and causal query-key pairs
  (compute-bound attention); swapped blocks. scikit-learn fits it by least squares on the relative
  error (weights ``1 / t^2``) with non-negative coefficients, and a prediction is one dot product, so a
  10,000-request virtual run does not pay a model call per step (Vidur, Agrawal et al., MLSys'24, fits
  random forests per operator and tabulates their predictions for the same reason). Measured on
  SmolLM2 (docs/results/simulator.md): a random forest did no better on held-out steps.
* ``RooflineStepModel`` (``framework.sim.roofline``) — analytic, for devices not here.
* :class:`ReplayStepModel` — the recorded step times of a real run, in order (the replay test).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from framework.sim.features import StepFeatures

KNOTS = (4, 16, 64)  # decode rows: hinges of the weight-streaming to compute-bound bend
PREFILL_CAPS = (128, 512)  # prefill tokens: min(tokens, cap) terms, so small chunks may cost more per token
SMALL_DECODE_BATCH = 8  # decode batches under this many rows run torch_paged's gather + SDPA path (min_paged_decodes)
BASIS = ("const", "decode_rows", *(f"decode_rows_over_{k}" for k in KNOTS), "prefill_tokens",
         *(f"prefill_tokens_upto_{c}" for c in PREFILL_CAPS), "prefill_reqs",
         "prefill_sampled", "decode_context", "decode_unique_context", "padded_decode_context_small_batch",
         "prefill_context",
         "prefill_pairs", "swap_blocks")
HELD_OUT_EVERY = 5  # every fifth sample is held out to report the fit's error before refitting on all
MIN_STEP_S = 1e-6  # a prediction is never below this, seconds


@dataclass(frozen=True)
class StepTime:
    """A predicted step, seconds."""

    step_s: float  # the whole engine step: schedule, execute, update (a virtual clock advances by it)
    execute_s: float  # the executor's share (a real-time simulator sleeps it; the rest runs for real)


class StepTimePredictor(ABC):
    """Predicts a step's time from its features.

    Attributes:
        source: how records name where the times come from (``measured:...``, ``analytic:h100``, ``replay:...``).
    """

    source: str = "unknown"

    @abstractmethod
    def predict(self, features: StepFeatures) -> StepTime:
        """Time of a step with these features; called by ``executor=sim`` once per step, in order."""


def basis(f: StepFeatures) -> list[float]:
    """The regression inputs of :data:`BASIS` for one step."""
    d = f.num_decode_reqs
    p = f.num_tokens - d
    return [1.0, d, *(max(0, d - k) for k in KNOTS), p, *(min(p, c) for c in PREFILL_CAPS), f.num_prefill_reqs,
            f.num_sampled - d,
            f.decode_context, f.decode_unique_context, d * f.max_decode_context if d < SMALL_DECODE_BATCH else 0,
            f.prefill_context, f.prefill_pairs,
            f.num_swap_blocks]


class LinearStepModel(StepTimePredictor):
    """``step_s = basis(f) . step_coef`` and ``execute_s = basis(f) . execute_coef`` (see the module docstring).

    Args:
        step_coef, execute_coef: one coefficient per :data:`BASIS` name, seconds per unit.
        source: the profile's label.
        held_out_mape: mean absolute relative error of ``step_s`` on held-out samples when fit.
    """

    def __init__(self, step_coef: Sequence[float], execute_coef: Sequence[float], source: str = "measured",
                 held_out_mape: float | None = None) -> None:
        if len(step_coef) != len(BASIS) or len(execute_coef) != len(BASIS):
            raise ValueError(f"a linear step model has {len(BASIS)} coefficients per target ({', '.join(BASIS)}); "
                             "re-measure the profile with this servelab (`servelab profile`)")
        self.step_coef = [float(c) for c in step_coef]
        self.execute_coef = [float(c) for c in execute_coef]
        self.source = source
        self.held_out_mape = held_out_mape

    def predict(self, features: StepFeatures) -> StepTime:
        """Dot products with the basis, floored at :data:`MIN_STEP_S`; ``execute_s <= step_s``."""
        x = basis(features)
        step_s = max(MIN_STEP_S, sum(a * b for a, b in zip(x, self.step_coef)))
        execute_s = min(step_s, max(MIN_STEP_S, sum(a * b for a, b in zip(x, self.execute_coef))))
        return StepTime(step_s, execute_s)

    @classmethod
    def fit(cls, samples: Sequence[dict[str, float]], source: str = "measured") -> LinearStepModel:
        """Fit on profile samples (:class:`StepFeatures` fields + ``step_s`` + ``execute_s``): first without
        every :data:`HELD_OUT_EVERY`-th sample to measure the held-out error, then on all of them.

        Raises:
            ValueError: fewer samples than coefficients.
        """
        if len(samples) < 2 * len(BASIS):
            raise ValueError(f"{len(samples)} profile samples cannot fit {len(BASIS)} coefficients; measure a larger "
                             "grid (servelab profile --grid default)")
        held = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
        train = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
        trial = cls(fit_coefficients(train, "step_s"), fit_coefficients(train, "execute_s"))
        mape = mean_relative_error(trial, held)
        return cls(fit_coefficients(samples, "step_s"), fit_coefficients(samples, "execute_s"), source, mape)

    def as_dict(self) -> dict[str, Any]:
        """The profile file's ``predictor`` entry."""
        return {"kind": "linear", "basis": list(BASIS), "step_coef": self.step_coef,
                "execute_coef": self.execute_coef, "held_out_mape": self.held_out_mape}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str) -> LinearStepModel:
        """Inverse of :meth:`as_dict`.

        Raises:
            ValueError: another kind or basis (a profile written by another version).
        """
        if values.get("kind") != "linear" or list(values.get("basis", ())) != list(BASIS):
            raise ValueError("the profile's predictor is not this servelab's linear step model; re-measure it "
                             "(`servelab profile`) or refit it (LinearStepModel.fit on its samples)")
        return cls(values["step_coef"], values["execute_coef"], source, values.get("held_out_mape"))


def fit_coefficients(samples: Sequence[dict[str, float]], target: str) -> list[float]:
    """Least squares of ``basis . coef`` against ``samples[target]``, weighted by ``1 / target^2`` (relative
    error), every coefficient non-negative (scikit-learn's ``LinearRegression(positive=True)``, on columns
    scaled to unit maximum for conditioning).

    Raises:
        ImportError: scikit-learn is not installed (the ``sim`` extra), naming the fix.
    """
    import numpy as np

    try:
        from sklearn.linear_model import LinearRegression
    except ImportError as err:
        raise ImportError("fitting a step-time model (servelab profile, executor=sim on samples) needs scikit-learn, "
                          "which the core install leaves out: pip install 'servelab[sim]'") from err

    x = np.array([basis(StepFeatures.from_dict(s)) for s in samples], dtype=np.float64)
    y = np.array([s[target] for s in samples], dtype=np.float64)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    model = LinearRegression(positive=True, fit_intercept=False)
    model.fit(x / scale, y, sample_weight=1.0 / np.maximum(y, MIN_STEP_S) ** 2)
    return [float(c) for c in model.coef_ / scale]


def mean_relative_error(predictor: StepTimePredictor, samples: Sequence[dict[str, float]]) -> float | None:
    """Mean of ``|predicted - measured| / measured`` step time over ``samples`` (``None`` when empty)."""
    if not samples:
        return None
    errors = [abs(predictor.predict(StepFeatures.from_dict(s)).step_s - s["step_s"]) / s["step_s"] for s in samples]
    return sum(errors) / len(errors)


class ReplayStepModel(StepTimePredictor):
    """The step times of a recorded run, handed out in order (a virtual clock fed a real run's timeline).

    Args:
        step_times_s: one duration per engine step that ran the model, seconds.
        source: label for records.

    Raises:
        RuntimeError: from :meth:`predict`, once more steps ran than were recorded (the simulated run
            diverged from the recorded one).
    """

    def __init__(self, step_times_s: Sequence[float], source: str = "replay") -> None:
        self.step_times_s = [float(t) for t in step_times_s]
        self.source = source
        self.num_steps = 0

    def predict(self, features: StepFeatures) -> StepTime:
        """The next recorded duration (as both the step's and the executor's time)."""
        if self.num_steps >= len(self.step_times_s):
            raise RuntimeError(f"replay: step {self.num_steps} ran but the recording has {len(self.step_times_s)} "
                               "steps; the simulated run took other decisions than the recorded one")
        t = self.step_times_s[self.num_steps]
        self.num_steps += 1
        return StepTime(t, t)
