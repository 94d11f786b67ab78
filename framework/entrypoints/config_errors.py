"""A configuration mistake prints its message alone: no Python traceback, no Hydra config search path.

``python run.py``, ``servelab`` and ``servelab serve`` run the Hydra app through :func:`run_app`, which
turns Hydra's own composition errors (an unknown option such as ``attention=nosuch``, an override that
does not parse or names no key) into one line. The app wraps its set-up (composed config ->
``EngineConfig`` -> plugin checks -> engine -> workload) in :func:`exit_on_config_error`: every error
raised there is a configuration mistake whose message already names the fix (the validating functions
raise ``ValueError``, ``FileNotFoundError`` or ``ImportError`` for exactly that), so the message is
printed and the process exits with :data:`EXIT_CODE`. Errors while the engine runs keep their traceback.

Developers get the tracebacks back with Hydra's own switch, ``HYDRA_FULL_ERROR=1``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from framework import registry

EXIT_CODE = 2  # a usage error, as argparse exits
#: Exceptions that the set-up raises for a configuration mistake, each with a message naming the fix.
CONFIG_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, ImportError,
                                                  registry.PluginConflictError, registry.PluginVersionError)
# run_app sets HYDRA_FULL_ERROR=1 so Hydra re-raises instead of printing its report; what the user had
# set is kept here (inherited by launcher child processes too)
_USER_FULL_ERROR = "SERVELAB_USER_HYDRA_FULL_ERROR"


def debugging() -> bool:
    """True when the user asked for full tracebacks (``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get(_USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", "")) == "1"


def report(message: str) -> None:
    """Print ``servelab: error: <message>`` to stderr."""
    print(f"servelab: error: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def exit_on_config_error() -> Iterator[None]:
    """Run a set-up block; a :data:`CONFIG_ERRORS` exception prints its message and exits with
    :data:`EXIT_CODE` (re-raised as is under ``HYDRA_FULL_ERROR=1``).

    Raises:
        SystemExit: on a configuration mistake.
    """
    try:
        yield
    except CONFIG_ERRORS as err:
        if debugging():
            raise
        report(str(err))
        raise SystemExit(EXIT_CODE) from None


def hydra_error_message(err: BaseException) -> str:
    """One message for a Hydra composition error: an unknown option lists the valid ones (as the plugin
    registry does), without Hydra's config search path."""
    from hydra.errors import MissingConfigException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options is not None:
        group, _, name = err.missing_cfg_file.rpartition("/")
        return f"unknown {group or 'config'} {name!r}; valid: {', '.join(sorted(err.options))}"
    message = str(err).split("\nConfig search path:")[0].strip()
    cause = err.__cause__
    if cause is not None and type(cause).__module__.startswith("omegaconf"):
        message += f"\n{cause}"
    return message


def run_app(app: Callable[[], Any]) -> Any:
    """Call a ``@hydra.main`` app; Hydra's composition and override errors print one message and exit
    with :data:`EXIT_CODE`. Other errors propagate with their full traceback.

    Raises:
        SystemExit: a configuration mistake (from Hydra, or from the app's :func:`exit_on_config_error`).
    """
    from hydra.errors import CompactHydraException

    saved = {key: os.environ.get(key) for key in ("HYDRA_FULL_ERROR", _USER_FULL_ERROR)}
    os.environ.setdefault(_USER_FULL_ERROR, os.environ.get("HYDRA_FULL_ERROR", ""))
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        return app()
    except CompactHydraException as err:
        if debugging():
            raise
        report(hydra_error_message(err))
        raise SystemExit(EXIT_CODE) from None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
