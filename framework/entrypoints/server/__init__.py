"""OpenAI-compatible HTTP server over :class:`~framework.engine.async_llm.AsyncLLM` (``serve`` extra).

``protocol`` request bodies, ``serving`` body -> engine requests, ``responses`` engine outputs ->
OpenAI bodies, ``app`` the FastAPI routes, ``served_models`` the served names (base model and LoRA
adapters, load/unload), ``metrics`` Prometheus ``servelab:*`` metrics, ``launch`` the ``mode=serve`` entry point. Nothing here is imported by the engine.
"""
