"""Served benchmarks: a server under load, against vLLM, routers, soak under faults, time to healthy."""
