"""The engine kernel's core (vLLM V1 ``v1/core`` + ``v1/request.py``): requests, sampling parameters,
the step's boundary dataclasses, the scheduler with its stop checks, detokenizer and swap space, and
the structured-output manager. Imports only ``framework.config``, ``framework.registry``,
``framework.hookspecs`` and ``framework.interfaces``; never the worker, engine or entry points."""
