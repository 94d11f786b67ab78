"""How the suite shares two pytest-xdist workers (``pytest -n 2 --dist loadfile``; a pytest plugin loaded by
``tests/conftest.py``).

* Order: xdist hands whole test files to the workers in collection order (``--no-loadscope-reorder`` in
  pyproject's addopts; xdist would otherwise order files by their number of tests, which handed the
  one-test, minute-long files out last). The longest files by ``tests/durations.json`` come first (longest
  processing time first: a long file handed out last keeps one worker busy while the other idles); a file
  missing from it counts as ``UNKNOWN_FILE_S``.
* Isolation: a test marked ``isolated`` (it checks machine-wide state such as ``/dev/shm``, or timing on the
  scale of seconds: heartbeats, deadlines) runs while no other test does: a readers-writer lock over two files
  shared by the test processes (every test holds the main lock shared, an isolated one exclusively; the
  turnstile lets a waiting isolated test in before new shared holders, so it cannot starve). Consecutive
  isolated tests of one worker keep the exclusive lock, waiting once for the other worker's test to end (keep
  a file's isolated tests next to each other). Serial runs take no lock.
* ``--store-durations``: each test file's seconds (setup + call + teardown of its tests, as the run measured
  them) are merged into ``tests/durations.json``; refresh it after adding or changing slow tests.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_FILE_S = 10.0  # a file not in tests/durations.json yet: about the suite's median file
_file_seconds: dict[str, float] = defaultdict(float)
LOCK_BASE_ENV = "SERVELAB_XDIST_LOCK"  # path prefix of the ".lock"/".turnstile" files, set by the controller
_LOCK_DIR = pytest.StashKey[Path]()
_held: dict[str, IO[str]] = {}  # "mode" -> "exclusive"/"shared" marker file, "lock" and "turnstile" handles


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller names the run's two lock files before it starts the workers (they inherit the
    environment), so that it can remove them when the run ends (``pytest_unconfigure``)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="servelab-xdist-"))
    config.stash[_LOCK_DIR] = folder
    os.environ[LOCK_BASE_ENV] = str(folder / "isolation")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the lock files' folder the controller made (a run leaves nothing in the temp folder)."""
    folder = config.stash.get(_LOCK_DIR, None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(LOCK_BASE_ENV, None)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help="merge each test file's seconds of this run into tests/durations.json")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _isolated(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("isolated") is not None


def order_files(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place by their file's recorded seconds, longest first; the tests of a file keep their
    order (a stable sort on a per-file key)."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(_file(item.nodeid), UNKNOWN_FILE_S))


def _acquire(exclusive: bool) -> None:
    import fcntl
    import tempfile

    base = Path(os.environ.get(LOCK_BASE_ENV) or
                Path(tempfile.gettempdir()) / f"servelab-xdist-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}")
    turnstile, lock = open(f"{base}.turnstile", "a+"), open(f"{base}.lock", "a+")
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    finally:
        fcntl.flock(turnstile, fcntl.LOCK_UN)
    _held.update(lock=lock, turnstile=turnstile, exclusive=exclusive)


def _release() -> None:
    import fcntl

    fcntl.flock(_held["lock"], fcntl.LOCK_UN)
    _held["lock"].close()
    _held["turnstile"].close()
    _held.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Hold the isolation lock over the test's setup, call and teardown (module fixtures included)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    exclusive = _isolated(item)
    if not (_held and _held["exclusive"] and exclusive):  # an exclusive lock kept from the previous test
        _acquire(exclusive)
    try:
        yield
    finally:
        if not (exclusive and _isolated(nextitem)):
            _release()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """``--store-durations`` (the xdist controller, or a serial run): merge this run's files into the file."""
    config = session.config
    if not config.getoption("store_durations") or hasattr(config, "workerinput") or not _file_seconds:
        return
    stored = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    stored.update({name: round(seconds, 1) for name, seconds in _file_seconds.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(stored.items(), key=lambda kv: -kv[1])), indent=0) + "\n")
