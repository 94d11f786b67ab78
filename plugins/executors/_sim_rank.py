"""The simulated rank of ``executor=sim``: the rank verbs ``build_engine`` and the engine call through
``collective_rpc`` (KV memory and block size, cache set-up, compile statistics), answered from the memory
model (``framework.sim.memory``) instead of a loaded model."""

from __future__ import annotations

import logging
import time
from typing import Any

from framework.config import EngineConfig
from framework.sim.memory import device_kv_budget, kv_cache_bytes_per_block, rank_attention_layers
from framework.sim.profile import StepProfile

logger = logging.getLogger(__name__)

MASK_TIMING_ROWS = 64  # bitmask rows timed to calibrate the structured-output cost


class SimRank:
    """Rank 0 of a simulated replica (every rank of a simulated TP group holds the same, so one answers).

    Args:
        profile: the measured/analytic profile the step times come from (``None``: analytic or replay).
        source: the predictor's label (``analytic:<device>`` selects the device's memory model).
        memory: ``auto`` (an analytic device's memory; otherwise the engine's rule) or ``engine``.
        gpu_memory_utilization: fraction of an analytic device's memory the engine may use.
    """

    def __init__(self, config: EngineConfig, hf_config: Any, profile: StepProfile | None, source: str, memory: str,
                 gpu_memory_utilization: float) -> None:
        from framework.core.kv_cache_groups import plan_kv_cache_layout

        self.config = config
        self.hf_config = hf_config
        self.device = source.removeprefix("analytic:") if source.startswith("analytic:") else None
        self.memory = memory
        self.gpu_memory_utilization = gpu_memory_utilization
        layers = rank_attention_layers(hf_config, config.tensor_parallel_size, config.mla_latent_cache)
        self.layout = plan_kv_cache_layout(config.kv_allocator, layers)
        self.num_blocks = 0
        self.num_swap_blocks = 0
        self.compiled = str(config.compile) == "true"

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block on a rank (``framework.sim.memory.kv_cache_bytes_per_block``)."""
        return kv_cache_bytes_per_block(self.config, self.hf_config, self.layout.layers_per_block)

    def determine_available_memory(self) -> int:
        """KV bytes per rank: on an analytic device (``memory=auto``) ``gpu_memory_utilization`` of its memory
        minus weights and activations; otherwise ``engine.kv_cache_memory_bytes`` capped at 90% of this
        machine's available RAM per rank, the real CPU worker's rule."""
        if self.memory == "auto" and self.device is not None:
            from framework.sim.roofline import DEVICES

            return device_kv_budget(self.config, self.hf_config, DEVICES[self.device].memory_bytes,
                                    self.gpu_memory_utilization)
        budget = self.config.kv_cache_memory_bytes
        if self.device is None:
            import psutil

            budget = min(budget, int(0.9 * psutil.virtual_memory().available // self.config.tensor_parallel_size))
        return budget

    def initialize_cache(self, num_blocks: int, num_swap_blocks: int = 0) -> None:
        """Record the pool's size (nothing is allocated)."""
        self.num_blocks, self.num_swap_blocks = num_blocks, num_swap_blocks

    def compile_stats(self) -> Any:
        """``CompileStats`` as a run with this ``engine.compile`` reports them (the profile was measured so)."""
        from framework.compilation.decoder import CompileStats

        return CompileStats(enabled=self.compiled, active=self.compiled)

    def compile_decoder(self) -> None:
        """``engine.compile=auto`` decided to compile: nothing to compile; the step times stay the profile's."""
        self.compiled = True
        logger.info("executor=sim: engine.compile=auto would compile now; simulated step times are unchanged")

    def set_keep_hidden_states(self, keep: bool) -> None:
        """Refused: a simulated model has no hidden states (drafters are simulated, see ``simulated_drafter``).

        Raises:
            RuntimeError: always when ``keep`` is set.
        """
        if keep:
            raise RuntimeError("executor=sim has no hidden states to return")

    def check_health(self) -> None:
        """Always healthy."""


def time_grammar_mask(config: EngineConfig) -> float:
    """Seconds to fill one structured-output bitmask row with the run's grammar engine on this machine
    (a JSON-object grammar, :data:`MASK_TIMING_ROWS` rows of a matcher advancing through ``{"a": 1}``),
    for simulated devices whose profile did not measure it."""
    from framework import registry
    from framework.model_executor.model_loader import load_model_config, load_tokenizer

    tokenizer, eos = load_tokenizer(config.model, config.tokenizer)
    vocab_size = load_model_config(config.model).vocab_size
    grammar = registry.create("grammar", config.grammar, tokenizer=tokenizer, vocab_size=vocab_size,
                              eos_token_ids=eos, **config.plugin_params("grammar"))
    if grammar is None:
        return 0.0
    import torch

    compiled = grammar.compile("json_object", "")
    bitmask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int32)
    ids = tokenizer('{"a": 1}', add_special_tokens=False).input_ids
    matcher = grammar.matcher(compiled)
    start = time.perf_counter()
    for i in range(MASK_TIMING_ROWS):
        if i and i % len(ids) == 0:  # the object closed: start another
            matcher = grammar.matcher(compiled)
        matcher.fill_bitmask(bitmask, 0)
        matcher.accept_token(ids[i % len(ids)])
    return (time.perf_counter() - start) / MASK_TIMING_ROWS
