"""Measurement (vLLM V1 ``v1/metrics``): per-step and per-request metrics of a run (TTFT, TPOT, ITL,
goodput, KV usage, spec-decode acceptance) and the sweep results table. Imports the kernel only."""
