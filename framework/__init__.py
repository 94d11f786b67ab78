"""servelab engine kernel: interfaces, registry, scheduler core, model runner, engine.

Heavy names (``LLM``, ``LLMEngine``, ``build_engine``) are imported lazily so that plugin
modules can ``from framework import hookimpl`` without loading transformers.
"""

from __future__ import annotations

from typing import Any

from framework import known_warnings
from framework.config import EngineConfig
from framework.core.lora_request import LoRARequest
from framework.core.outputs import CompletionOutput, RequestOutput
from framework.core.sampling_params import SamplingParams
from framework.core.structured_output_params import StructuredOutputsParams
from framework.hookspecs import hookimpl

known_warnings.install()  # before anything imports transformers (and, through it, torchao)

_LAZY = {"LLM": "framework.entrypoints.llm", "LLMEngine": "framework.engine.llm_engine",
         "build_engine": "framework.entrypoints.engine"}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "build_engine", "hookimpl"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'framework' has no attribute {name!r}")
