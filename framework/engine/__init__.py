"""The engine loop (vLLM V1 ``v1/engine``): ``LLMEngine`` (schedule -> execute -> update -> observe),
``build_engine`` and the asyncio front end ``AsyncLLM``. Imports the kernel, the worker, metrics and
workloads; never the entry points."""
