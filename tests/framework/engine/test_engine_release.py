"""``del llm`` frees the engine at once (its KV cache is 1 GiB by default): no reference cycle keeps an engine
alive until Python's next full garbage collection, which with torch loaded can be many engines later (a test
suite or a sweep that builds engine after engine grew to 16 GB and was killed for memory)."""

from __future__ import annotations

import gc
import weakref

import pytest
from helpers import STORIES

from framework import LLM, SamplingParams


@pytest.mark.parametrize("kwargs", [{}, {"drafter": "ngram"}, {"data_parallel_size": 2, "executor": "uniproc"}],
                         ids=["plain", "ngram", "dp2"])
def test_del_llm_frees_its_engine_without_a_garbage_collection(kwargs):
    llm = LLM(model=STORIES, compile=False, num_blocks=64, **kwargs)
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=4))
    gc.collect()
    gc.disable()
    try:
        engine = weakref.ref(llm.engine)
        del llm
        assert engine() is None, [type(r).__name__ for r in gc.get_referrers(engine())]
    finally:
        gc.enable()
