"""``executor.params.profile`` -> the step-time predictor of a simulated run.

Accepted values:

* ``auto`` — the profile of this model on this device with these engine settings
  (:func:`~framework.sim.profile.profile_key`): a shipped one, else one cached earlier, else one measured
  now with the real engine (a progress line says so; minutes) and cached for next time;
* ``analytic:<device>`` — the roofline model of ``framework.sim.roofline`` (``h100``, ``h200``, ``a100``,
  ``l4``);
* ``replay:<file>`` — the step times of a recorded run, in order (a JSON list of seconds, or a JSON
  object with ``step_times_s``);
* a path — a profile file written by ``servelab profile`` (measured or analytic).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from framework.config import EngineConfig
from framework.sim.predictor import LinearStepModel, ReplayStepModel, StepTimePredictor
from framework.sim.profile import StepProfile, cache_path, find_profile, measured_device, profile_key
from framework.sim.roofline import DEVICES, RooflineStepModel

logger = logging.getLogger(__name__)

#: measures a profile with the real engine for a config (``framework.engine.profiler.measure_profile``)
Measure = Callable[[EngineConfig], StepProfile]


def check_profile_spec(spec: Any) -> str | None:
    """Why ``spec`` is not a valid ``executor.params.profile`` (``None``: it is), without reading files
    that ``auto`` would search."""
    if not isinstance(spec, str) or not spec:
        return f"executor.params.profile must be auto, analytic:<device>, replay:<file> or a profile file, got {spec!r}"
    if spec.startswith("analytic:") and spec.split(":", 1)[1] not in DEVICES:
        return f"executor.params.profile={spec}: unknown device; known: {', '.join('analytic:' + d for d in DEVICES)}"
    if spec.startswith("replay:") and not Path(spec.split(":", 1)[1]).is_file():
        return f"executor.params.profile={spec}: no such file (a JSON list of step times, seconds)"
    if spec != "auto" and not spec.startswith(("analytic:", "replay:")) and not Path(spec).is_file():
        return (f"executor.params.profile={spec}: no such profile file; write one with `servelab profile model=...`, "
                "or use auto or analytic:<device>")
    return None


def resolve_predictor(spec: str, config: EngineConfig, hf_config: Any, num_threads: int,
                      measure: Measure) -> tuple[StepTimePredictor, StepProfile | None]:
    """The predictor ``spec`` names, and the profile it came from (``None`` for analytic and replay).

    Args:
        num_threads: torch threads of this process (part of a measured profile's device).
        measure: how ``auto`` measures a missing profile.

    Raises:
        ValueError, FileNotFoundError: a bad spec or file (the message names the fix).
    """
    problem = check_profile_spec(spec)
    if problem:
        raise ValueError(problem)
    if spec.startswith("analytic:"):
        return RooflineStepModel(spec.split(":", 1)[1], hf_config, config), None
    if spec.startswith("replay:"):
        path = Path(spec.split(":", 1)[1])
        body = json.loads(path.read_text(encoding="utf-8"))
        times = body.get("step_times_s") if isinstance(body, dict) else body
        if not isinstance(times, list) or not times:
            raise ValueError(f"{path}: a replay file is a JSON list of step times (seconds) or {{'step_times_s': [...]}}")
        return ReplayStepModel(times, source=f"replay:{path.name}"), None
    if spec == "auto":
        key = profile_key(config, hf_config, measured_device(config, num_threads))
        path = find_profile(key)
        if path is None:
            profile = measure(config)
            path = profile.save(cache_path(profile))
            logger.info("profile=auto: measured profile cached at %s", path)
        profile = StepProfile.load(path)
        logger.info("profile=auto: %s (%s)", path, profile.label)
    else:
        profile = StepProfile.load(spec)
        _warn_on_mismatch(profile, config, hf_config, num_threads)
    return predictor_of(profile, config, hf_config), profile


def predictor_of(profile: StepProfile, config: EngineConfig, hf_config: Any) -> StepTimePredictor:
    """The predictor a loaded profile holds: its fitted regression (measured) or the roofline of its device
    at this run's settings (analytic).

    Raises:
        ValueError: a measured profile without a fitted predictor of this version.
    """
    if profile.source == "analytic":
        return RooflineStepModel(profile.key["device"].removeprefix("analytic:"), hf_config, config)
    return LinearStepModel.from_dict(profile.predictor, profile.label)


def _warn_on_mismatch(profile: StepProfile, config: EngineConfig, hf_config: Any, num_threads: int) -> None:
    """Log which settings of an explicitly chosen profile differ from the run's (it is used anyway)."""
    if profile.source != "measured":
        return
    run = profile_key(config, hf_config, measured_device(config, num_threads))
    differ = sorted(k for k in run if profile.key.get(k) != run[k])
    if differ:
        logger.warning("profile %s was measured with other settings (%s: %s vs this run's %s); its step times are "
                       "used as they are", profile.label, ", ".join(differ),
                       [profile.key.get(k) for k in differ], [run[k] for k in differ])
