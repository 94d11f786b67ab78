"""Helpers of the executor=sim tests: profiles with known step times (no measuring)."""

from __future__ import annotations

from pathlib import Path

from framework.sim.predictor import BASIS, LinearStepModel
from framework.sim.profile import StepProfile


def linear_profile(path: Path, const_s: float = 0.05, **per_unit_s: float) -> str:
    """A measured-profile file whose step time is ``const_s`` plus ``per_unit_s[name] * feature`` for
    :data:`~framework.sim.predictor.BASIS` names (executor time = step time); returns its path."""
    unknown = set(per_unit_s) - set(BASIS)
    assert not unknown, unknown
    coef = [const_s if name == "const" else per_unit_s.get(name, 0.0) for name in BASIS]
    model = LinearStepModel(coef, coef, source="measured")
    StepProfile(source="measured", key={}, predictor=model.as_dict(), grammar_mask_s_per_row=1e-4,
                meta={"model": "constant"}).save(path)
    return str(path)
