"""``servelab profile``: measure one model's step times on this device with the real engine, fit a step-time
predictor on them and write a profile file for ``executor=sim`` (or an analytic one for a device not here).

    servelab profile [model=... engine.compile=false ...] [--out FILE] [--grid default|quick] [--passes N]
    servelab profile --merge A.json B.json --out C.json     # pool passes measured at different times
    servelab profile model=llama3_70b parallel.tensor_parallel_size=8 device=h100    # analytic, no measuring

The overrides are the run config's (``conf/``), so the profile is measured with the engine settings a run
would use; ``device=`` names one of ``framework.sim.roofline.DEVICES`` for an analytic profile. Without
``--out`` a measured profile goes to the cache that ``executor.params.profile=auto`` searches.

The grid and what a sample holds: ``framework/engine/profiler.py``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from framework.sim.profile import StepProfile, cache_path

logger = logging.getLogger(__name__)


def compose_config(overrides: list[str]) -> Any:
    """The run config (``conf/config.yaml``) composed with ``overrides``, as ``run.py`` would.

    Raises:
        ValueError: Hydra refuses an override (unknown group option or key).
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from framework.entrypoints.hydra_config import CONF_DIR, register_config_nodes

    register_config_nodes()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except HydraException as exc:
        raise ValueError(str(exc)) from exc


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    from framework.engine.profiler import GRIDS

    parser = argparse.ArgumentParser(prog="servelab profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="profile file to write (default: the cache that profile=auto searches)")
    parser.add_argument("--grid", default="default", choices=sorted(GRIDS), help="cells to measure (quick: tests)")
    parser.add_argument("--seed", type=int, default=0, help="prompt token ids' seed")
    parser.add_argument("--passes", type=int, default=1, help="measure the grid this many times (a shared machine's "
                        "speed drifts; more passes average it)")
    parser.add_argument("--merge", nargs="+", metavar="FILE", help="pool these measured profiles (same key) and refit")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``servelab profile [overrides] [--out FILE] [--grid NAME]``; returns the exit status.

    Raises:
        SystemExit: a configuration mistake (status 2, the message alone).
    """
    from framework.engine.profiler import GRIDS, Progress, measure_profile, merge_profiles
    from framework.entrypoints.config_errors import exit_on_config_error
    from framework.entrypoints.hydra_config import engine_config_from_cfg
    from framework.sim.roofline import DEVICES, analytic_profile

    args, overrides = _parse(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with exit_on_config_error():
        if args.merge:

            profile = merge_profiles([StepProfile.load(path) for path in args.merge])
            print(f"wrote merged profile {profile.save(args.out or cache_path(profile))}")
            return 0
        device = next((o.split("=", 1)[1] for o in overrides if o.startswith("device=")), "cpu")
        analytic = device.lower() in DEVICES
        cfg = compose_config([o for o in overrides if not (analytic and o.startswith("device="))])
        config = engine_config_from_cfg(cfg)
        if analytic:
            from framework.engine.builder import resolve_dtype
            from framework.model_executor.model_loader import load_model_config

            config = resolve_dtype(config)
            profile = analytic_profile(device.lower(), load_model_config(config.model), config)
        else:
            print(f"servelab profile: measuring {config.model} on this {config.device} with the real engine "
                  f"({len(GRIDS[args.grid])} cells)", flush=True)
            profile = measure_profile(config, args.grid, args.seed, passes=args.passes, progress=Progress("  "))
    path = profile.save(args.out or cache_path(profile))
    error = profile.predictor.get("held_out_mape")
    print(f"wrote {profile.source} profile {path}" + (f" (held-out step-time error {100 * error:.1f}%)"
                                                      if error is not None else ""))
    return 0
