"""KV connector conformance on real engines (``kv_connector=<name>``): token-exact float32 greedy outputs against
one plain engine, with the connector's engines under any executor and parallel layout (``executor=mp
tensor_parallel_size=2``: one worker side per rank in processes of their own, reports merged by the executor).

The model-free contract is :func:`framework.testing.kv_connector.check_kv_connector`; this runs the whole path:
the scheduler side's lookups and metadata, the step message to every rank, each rank's loads and saves around its
forward, the merged report back. A connector checked under ``executor=mp`` must reach worker processes through an
installed entry point (a plugin registered only in the test's process is refused by the executor)."""

from __future__ import annotations

import random
from typing import Any

from framework import LLM  # the engine as users build it (as check_scheduler_policy's engine run)
from framework.core.sampling_params import SamplingParams

_BLOCK = 4  # tokens per KV block: small, so short prompts span several blocks


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Three prompts of 5, 3 and 1.5 blocks sharing their first two blocks, and one shorter than a block."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(2 * _BLOCK)]
    return [shared + [rng.randrange(3, vocab_size) for _ in range(3 * _BLOCK)],
            shared + [rng.randrange(3, vocab_size) for _ in range(_BLOCK + 1)],
            [rng.randrange(3, vocab_size) for _ in range(_BLOCK + 2)],
            [rng.randrange(3, vocab_size) for _ in range(2)]]


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    errors = [o.error for o in outs if o.error is not None]
    assert not errors, f"a request failed: {errors[0]}"
    return [list(o.outputs[0].token_ids) for o in outs]


def _no_leak(llm: LLM, what: str) -> None:
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, f"the {what} engine still holds KV blocks after its requests finished"


def check_kv_connector_engine(name: str, model: str, own_store: bool = False, max_tokens: int = 6, seed: int = 0,
                              connector_params: dict[str, Any] | None = None, **engine: Any) -> None:
    """Run ``kv_connector=name`` on real engines and compare every output with one plain engine's.

    ``own_store=False`` (a store engines share: ``shared_storage``): a ``kv_producer`` engine runs the prompts, then a
    ``kv_consumer`` engine runs them again and must load some prompt tokens from the store. ``own_store=True`` (a
    store inside the engine: ``offload``): one ``kv_both`` engine runs the prompts, drops its local prefix cache,
    and runs them again, loading from its own store.

    Args:
        name: the registered ``kv_connector`` name.
        model: a model path (e.g. ``<servelab>/models/stories260K``); run in float32, eager, block size 4.
        own_store: see above.
        max_tokens: greedy tokens per prompt.
        seed: the prompts' token ids (four prompts: shared prefixes, partial and full-block hits, one shorter than a
            block).
        connector_params: ``kv_connector.params`` (e.g. ``{"path": <a fresh folder>}``).
        **engine: further engine settings of the connector's engines, e.g. ``executor="mp",
            tensor_parallel_size=2`` (the plain engine runs one rank in-process).

    Raises:
        AssertionError: outputs that differ from the plain engine's (naming the prompt), no tokens loaded from the
            store, a failed request or a leaked block.
    """
    base = dict(model=model, dtype="float32", compile=False, block_size=_BLOCK, num_blocks=128, max_model_len=128)
    plain_llm = LLM(**base)
    try:
        prompts = _prompts(plain_llm.engine.tokenizer.vocab_size, seed)
        expected = _generate(plain_llm, prompts, max_tokens)
    finally:
        plain_llm.engine.shutdown()
    params = dict(base, **engine, kv_connector=name, kv_connector_params=dict(connector_params or {}))
    roles = ["kv_both"] if own_store else ["kv_producer", "kv_consumer"]
    llms = {role: LLM(**params, kv_role=role) for role in roles}
    try:
        first, second = llms[roles[0]], llms[roles[-1]]
        _check(_generate(first, prompts, max_tokens), expected, f"the {roles[0]} engine")
        _no_leak(first, roles[0])
        if own_store:
            first.engine.scheduler.reset_prefix_cache()  # the next run must come from the connector's store
        hits_before = second.engine.scheduler.kv_transfer.external_prefix_cache_hits
        _check(_generate(second, prompts, max_tokens), expected, f"the {roles[-1]} engine's run from the store")
        _no_leak(second, roles[-1])
        hits = second.engine.scheduler.kv_transfer.external_prefix_cache_hits - hits_before
        assert hits > 0, f"kv_connector={name}: the {roles[-1]} engine loaded no prompt token from the store"
    finally:
        for llm in llms.values():
            llm.engine.shutdown()


def _check(got: list[list[int]], expected: list[list[int]], what: str) -> None:
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{what}: prompt {i} gave {g}, the plain engine {e} (float32 greedy must be token-exact)"
