"""The ``servelab`` command: the Hydra app (``servelab [overrides]`` == ``python run.py [overrides]``)
plus subcommands.

    servelab results SWEEP_DIR [--plot KEY ...]   sweep dir -> CSV/Markdown table, PNGs, HTML
    servelab plugins                               every registered plugin per kind, package, capabilities
    servelab models [--markdown]                   the model families servelab runs, their needs, backends, tests
    servelab serve [overrides]                     == python run.py mode=serve [overrides]
    servelab eval [overrides]                      == python run.py mode=eval [overrides] (lm-eval scores)
    servelab profile [overrides] [--out FILE]      step times of the model on this device -> a profile for executor=sim
    servelab rerun RUN_DIR [key=value ...]         == python run.py --config-path RUN_DIR/.hydra --config-name config
    servelab proxy --prefill URL --decode URL      P/D: prefill on one server, decode on another (vLLM's toy proxy)

``--config-path`` (not ``--config-dir``): Hydra searches ``--config-dir`` *after* the app's own
``conf/``, whose ``config.yaml`` would then win; ``--config-path`` replaces the primary dir. The
saved config is fully composed (no defaults list), so overrides are plain keys
(``tracker.name=none``), not group choices.
"""

from __future__ import annotations

import sys
from pathlib import Path

SUBCOMMANDS = ("results", "plugins", "models", "serve", "eval", "rerun", "profile", "proxy")


def _run_hydra(argv: list[str]) -> None:
    """Run ``run.main`` (the Hydra app) with ``argv`` as its command line; a configuration mistake prints
    its message alone and exits with status 2 (``framework/entrypoints/config_errors.py``)."""
    import run
    from framework.entrypoints.config_errors import run_app

    sys.argv = [sys.argv[0], *argv]
    run_app(run.main)


def rerun_argv(run_dir: str | Path, overrides: list[str]) -> list[str]:
    """Hydra argv that recomposes a finished run from its saved ``.hydra/config.yaml`` into a new run dir
    (``RUN_DIR/rerun-<n>``), so the original files stay.

    Raises:
        FileNotFoundError: ``RUN_DIR/.hydra/config.yaml`` is missing (not a servelab run dir).
    """
    hydra_dir = Path(run_dir).resolve() / ".hydra"
    if not (hydra_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{hydra_dir / 'config.yaml'} not found: RUN_DIR must be a finished run's directory")
    n = 0
    while (hydra_dir.parent / f"rerun-{n}").exists():
        n += 1
    return ["--config-path", str(hydra_dir), "--config-name", "config",
            f"hydra.run.dir={hydra_dir.parent / f'rerun-{n}'}", *overrides]


def main(argv: list[str] | None = None) -> int | None:
    """Dispatch on the first argument: a subcommand, or else the Hydra app with all arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command == "results":
        from framework.metrics.results import main as results_main

        return results_main(argv[1:])
    if command == "plugins":
        from framework.entrypoints.plugin_info import main as plugins_main

        return plugins_main(argv[1:])
    if command == "models":
        from framework.entrypoints.model_info import main as models_main

        return models_main(argv[1:])
    if command == "profile":
        from framework.entrypoints.profile import main as profile_main

        return profile_main(argv[1:])
    if command == "proxy":
        try:
            from framework.entrypoints.proxy import main as proxy_main
        except ImportError as exc:
            print(f"servelab proxy needs the serve extra ({exc}): pip install -e '.[serve]' 'torch==2.13.0'",
                  file=sys.stderr)
            return 2

        return proxy_main(argv[1:])
    if command in ("serve", "eval"):  # mode last: Hydra's argparse takes no override before ``-m``
        return _run_hydra([*argv[1:], f"mode={command}"])
    if command == "rerun":
        if len(argv) < 2:
            print("usage: servelab rerun RUN_DIR [overrides ...]", file=sys.stderr)
            return 2
        return _run_hydra(rerun_argv(argv[1], argv[2:]))
    return _run_hydra(argv)


if __name__ == "__main__":
    sys.exit(main())
