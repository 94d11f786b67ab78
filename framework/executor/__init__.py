"""Machinery shared by the executors that run worker ranks outside the engine's thread: the
shared-memory step broadcast and the worker-process loop (the executor classes themselves are
plugins: ``plugins/executors/``)."""
