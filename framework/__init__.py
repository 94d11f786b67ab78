"""servelab engine kernel: interfaces, registry, scheduler core, model runner, engine.

Heavy names (``LLM``, ``LLMEngine``, ``build_engine``) are imported lazily so that plugin
modules can ``from framework import hookimpl`` without loading transformers.
"""

from __future__ import annotations

from typing import Any

from framework.config import EngineConfig
from framework.hookspecs import hookimpl
from framework.outputs import CompletionOutput, RequestOutput
from framework.sampling_params import SamplingParams
from framework.structured_output_params import StructuredOutputsParams

_LAZY = {"LLM": "framework.llm", "LLMEngine": "framework.engine", "build_engine": "framework.engine"}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "build_engine", "hookimpl"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
