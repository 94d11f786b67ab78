"""Multi-turn conversations for the KV connector tests (tests/plugins/kv_connectors): stories260K in float32,
greedy, at a KV budget (``TIGHT``) smaller than the conversations' working set."""

from __future__ import annotations

from helpers import STORIES

from framework import LLM, SamplingParams

MODEL = STORIES
BLOCK = 4
ENGINE = dict(model=MODEL, dtype="float32", compile=False, block_size=BLOCK, num_blocks=128, max_model_len=64)
TIGHT = {**ENGINE, "num_blocks": 16}  # 64 tokens of KV: one conversation's last turn, not three conversations
GREEDY = SamplingParams(temperature=0, max_tokens=8)
OPENINGS = ["Once upon a time there was a little girl named Lily", "Tom had a big red ball",
            "The sun was hot and the bird sang"]
FOLLOW_UP = " Then she said"
NUM_TURNS = 3


def conversations(llm: LLM, batched: bool = False) -> list[list[int]]:
    """Three conversations of NUM_TURNS turns run interleaved (A1 B1 C1 A2 ...), one request at a time (``batched``:
    each turn of the three in one ``generate``); each turn's prompt is the previous prompt, its output and a
    follow-up. Returns every turn's output token ids, in order."""
    tok = llm.engine.tokenizer
    follow = [t for t in tok(FOLLOW_UP).input_ids if t != tok.bos_token_id]
    prompts = [tok(text).input_ids for text in OPENINGS]
    outputs = []
    for _ in range(NUM_TURNS):
        groups = [list(range(len(prompts)))] if batched else [[i] for i in range(len(prompts))]
        for group in groups:
            for i, out in zip(group, llm.generate([prompts[i] for i in group], GREEDY)):
                assert out.error is None
                outputs.append(list(out.outputs[0].token_ids))
                prompts[i] = prompts[i] + outputs[-1] + follow
    return outputs


def assert_no_leak(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks, "a finished run still holds KV blocks"


def greedy_run(prompts: list[str], **kwargs) -> tuple[list[list[int]], int]:
    """Greedy token ids of a fresh ``LLM(**ENGINE, **kwargs)`` over ``prompts`` and its connector's external prefix
    hits (tokens; 0 without a connector); no block leaked; the engine shut down."""
    llm = LLM(**ENGINE, **kwargs)
    try:
        outputs = llm.generate(prompts, GREEDY)
        assert all(o.error is None for o in outputs)
        assert_no_leak(llm)
        transfer = llm.engine.scheduler.kv_transfer
        return [o.outputs[0].token_ids for o in outputs], transfer.external_prefix_cache_hits if transfer else 0
    finally:
        llm.engine.shutdown()
