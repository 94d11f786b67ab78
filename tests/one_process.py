"""Run several command lines one after another in this one Python process, each as ``python ARGV`` would
run it: ``ARGV[0]`` a script run as ``__main__`` (``run.py``), or ``-m MODULE`` (``-m framework.entrypoints.cli``).

A test helper (``helpers.run_in_one_process`` starts it): end-to-end tests of the ``servelab`` command lines
pay the interpreter's start-up and the imports of torch, transformers and Hydra (several CPU seconds) once
per test module instead of once per command. Each command's file descriptors 1 and 2 go to its own files
(C-level output included), its exit status is what ``python`` would return: ``SystemExit``'s code, 0 when the
script returns, 1 with the traceback printed to its stderr when an exception escapes.

Usage: ``python tests/one_process.py CASES_JSON STATUS_JSON``; ``CASES_JSON`` holds ``[{"argv": [...], "stdout":
path, "stderr": path}, ...]``; ``STATUS_JSON`` receives one JSON list of their exit statuses.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path


def exit_status(code: object) -> int:
    """The process exit status ``python`` gives ``SystemExit(code)``; a message is printed to stderr."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_one(argv: list[str]) -> int:
    """Run one command line in this process (``argv`` as after ``python``); returns its exit status."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # a new process starts without one; a Hydra app leaves it set
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exit_status(exc.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1
    return 0


def main(cases_path: str, status_path: str) -> None:
    """Run every case of ``cases_path`` in order; write their exit statuses to ``status_path`` (a JSON list)."""
    sys.path[0] = os.getcwd()  # as for ``python run.py`` / ``python -m`` started in the repository root
    real_out, real_err = os.dup(1), os.dup(2)
    statuses = []
    for case in json.loads(Path(cases_path).read_text()):
        with open(case["stdout"], "w") as out, open(case["stderr"], "w") as err:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
            try:
                statuses.append(run_one(case["argv"]))
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(real_out, 1), os.dup2(real_err, 2)
    Path(status_path).write_text(json.dumps(statuses))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
