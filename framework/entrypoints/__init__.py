"""What users call (vLLM ``entrypoints``): the offline ``LLM``, the OpenAI-compatible server, the
``servelab`` CLI, the Hydra glue of ``run.py``, the offline workload runner, run records and the
dashboard. The top layer: nothing in ``framework`` imports it except the lazy names of
``framework/__init__.py``."""
