"""Offline throughput against transformers and vLLM; parallelism, model families, speculation, grammars."""
