"""Tracker: a lifecycle observer (W&B, JSON, console) built from config and registered as a
pluggy plugin for the run's duration."""

from __future__ import annotations

from typing import Any

from framework.interfaces.base import Plugin


class Tracker(Plugin):
    """Base of trackers. Subclasses implement any of the lifecycle hooks of
    ``framework.hookspecs`` (``on_engine_start``, ``on_step_end``, ``on_request_finished``,
    ``on_run_end``) as ``@hookimpl`` methods; the run registers the instance with the plugin
    manager while it runs and calls :meth:`close` at the end.

    Args:
        run_dir: folder where the tracker may write files (the Hydra run dir).
    """

    def __init__(self, run_dir: str = ".", **params: Any) -> None:
        self.run_dir = run_dir
        self.params = params

    def close(self) -> None:
        """Flush and release resources; called once after ``on_run_end``."""
