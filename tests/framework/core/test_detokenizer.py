"""Incremental detokenizer, stop strings across deltas, and output kinds (issue 7).

The tokenizer oracle is the tokenizer's own full ``decode``; stories260K is a SentencePiece
(byte-fallback) tokenizer, SmolLM2 a byte-level BPE one (slow test).
"""

from __future__ import annotations

import pytest
from helpers import STORIES

from framework.core.detokenizer import IncrementalDetokenizer
from framework.core.sampling_params import RequestOutputKind, SamplingParams

TEXTS = ["Once upon a time, héllo wörld 日本語 🙂 done.", "ü", "🙂🙂x", "Tom said \"hi\".\nThe end."]


def _stream(tok, ids: list[int], **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    detok, pieces = IncrementalDetokenizer(tok, **kw), []
    for t in ids:
        before = len(detok.text)
        detok.append(t)
        pieces.append(detok.text[before:])
    return detok, pieces


def _check_tokenizer(tok) -> None:
    assert IncrementalDetokenizer(tok)._stream is not None  # both are fast tokenizers: DecodeStream path
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False).input_ids
        detok, pieces = _stream(tok, ids)
        assert detok.text == tok.decode(ids, skip_special_tokens=True)
        python, python_pieces = _stream(tok, ids, use_decode_stream=False)  # same pieces on both paths
        assert python._stream is None and python_pieces == pieces
        assert "".join(pieces) == detok.text and not any("\ufffd" in p for p in pieces)
        for p in pieces:  # never a split character: every piece is valid UTF-8 text on its own
            p.encode("utf-8")
    ids = tok(TEXTS[0], add_special_tokens=False).input_ids
    with_special = ids[:5] + [tok.eos_token_id] + ids[5:]  # a skipped special token mid-stream
    for skip in (True, False):
        fast, fast_pieces = _stream(tok, with_special, skip_special_tokens=skip)
        _, python_pieces = _stream(tok, with_special, skip_special_tokens=skip, use_decode_stream=False)
        assert fast_pieces == python_pieces and fast.text == tok.decode(with_special, skip_special_tokens=skip)
    multi = tok("🙂", add_special_tokens=False).input_ids
    if len(multi) > 1:  # byte tokens: nothing is emitted before the character is complete
        _, pieces = _stream(tok, multi)
        assert pieces[:-1] == [""] * (len(multi) - 1) and pieces[-1].strip() == "🙂"


def test_sentencepiece_stories260k() -> None:
    from transformers import AutoTokenizer

    _check_tokenizer(AutoTokenizer.from_pretrained(STORIES))


@pytest.mark.slow
def test_byte_level_bpe_smollm2() -> None:
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path

    _check_tokenizer(AutoTokenizer.from_pretrained(resolve_model_path("smollm2")))


def test_stop_string_spanning_tokens_is_trimmed() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES)
    ids = tok("Once upon a time there was a dog", add_special_tokens=False).input_ids
    detok, _ = _stream(tok, ids, stop=["time th"])
    assert detok.stop_reason == "time th" and detok.text == "Once upon a "
    keep, _ = _stream(tok, ids, stop=["time th"], include_stop_str_in_output=True)
    assert keep.text == "Once upon a time th"
    assert detok.stop_buffer_length == len("time th") - 1


class _CharTokenizer:
    """One token per character: ids are code points (makes deltas easy to reason about)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def test_stop_search_window_is_incremental() -> None:
    """A stop string completed by the last char is found; text before the window is never rescanned."""
    detok = IncrementalDetokenizer(_CharTokenizer(), stop=["abc"])
    for ch in "xxabxab":
        assert detok.append(ord(ch)) is None
    assert detok.append(ord("c")) == "abc" and detok.text == "xxabx"
    assert detok.append(ord("z")) == "abc" and detok.text == "xxabx"  # finished: no more text


def _run(engine, params: SamplingParams, prompt: list[int]) -> list:
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


@pytest.mark.parametrize("stop_len", [0, 2, 4])
def test_output_kinds_agree(make_llm, stop_len: int) -> None:
    engine = make_llm().engine
    prompt = [1, 403, 407, 261]
    plain = _run(engine, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), prompt)[-1].outputs[0].text
    mid = len(plain) // 2
    stop = [plain[mid:mid + stop_len]] if stop_len else []  # a stop string in the middle of the output
    base = dict(max_tokens=24, temperature=0.0, stop=stop, ignore_eos=True)
    final = _run(engine, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY), prompt)
    cumulative = _run(engine, SamplingParams(**base), prompt)
    delta = _run(engine, SamplingParams(**base, output_kind=RequestOutputKind.DELTA), prompt)
    assert len(final) == 1 and final[0].finished
    want = final[0].outputs[0]
    assert cumulative[-1].outputs[0].text == want.text and cumulative[-1].outputs[0].token_ids == want.token_ids
    for a, b in zip(cumulative, cumulative[1:]):  # cumulative text only grows
        assert b.outputs[0].text.startswith(a.outputs[0].text)
    assert "".join(o.outputs[0].text for o in delta) == want.text
    assert sum((o.outputs[0].token_ids for o in delta), []) == want.token_ids
    assert len(delta) == len(cumulative) > 1
    if stop:
        assert want.stop_reason == stop[0] and want.text == plain[:plain.index(stop[0])]
    for s in stop:  # a stop string never leaks into any streamed piece, even across deltas
        assert all(s not in o.outputs[0].text for o in cumulative)


# ---- random token streams (issue 34): DecodeStream's "Invalid prefix" must never escape ---------------------
# stories260K byte tokens <0x58> ('X') then invalid bytes: ByteFallback turns the printed 'X' into U+FFFD, which
# made DecodeStream raise "Invalid prefix encountered" (sampled at temperature 1.0 by a user of the server)
INVALID_PREFIX_IDS = [70, 91, 133, 153, 39, 82, 400, 282, 241]


@pytest.fixture(scope="module")
def tokenizers_under_test():
    """Every tokenizer the project ships or tests: SentencePiece byte fallback (stories260K), byte-level BPE
    (SmolLM2, tokenizer files only) and the code-point tokenizer of these tests (Python path)."""
    from transformers import AutoTokenizer

    from framework.model_executor.model_loader import resolve_model_path

    return {"stories260K": AutoTokenizer.from_pretrained(STORIES),
            "smollm2": AutoTokenizer.from_pretrained(resolve_model_path("smollm2")),
            "chars": _CharTokenizer()}


def test_invalid_prefix_falls_back_to_python_path(tokenizers_under_test) -> None:
    from tokenizers.decoders import DecodeStream

    tok = tokenizers_under_test["stories260K"]
    stream = DecodeStream(skip_special_tokens=True)
    with pytest.raises(Exception, match="Invalid prefix"):  # the upstream failure this guards against
        for t in INVALID_PREFIX_IDS:
            stream.step(tok._tokenizer, t)
    detok, pieces = _stream(tok, INVALID_PREFIX_IDS)
    assert detok._stream is None, "the DecodeStream error did not switch the request to the Python path"
    assert "".join(pieces) == detok.text == "CX\ufffd\ufffd\ufffd\ufffd do p"  # invalid bytes: U+FFFD


def _vocab(name: str, tok) -> int:
    return 0x10FFFF if name == "chars" else len(tok)


@pytest.mark.parametrize("name", ["stories260K", "smollm2", "chars"])
def test_random_token_streams_never_raise(tokenizers_under_test, name: str) -> None:
    """Any token stream (uniform ids, byte-token-heavy runs, special tokens) detokenizes without an exception;
    pieces are valid text; on byte-level BPE (a monotonic decoder) the text is a prefix of the full decode."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tok = tokenizers_under_test[name]
    vocab = _vocab(name, tok)
    ids_st = st.lists(st.one_of(st.integers(0, vocab - 1), st.integers(0, min(vocab, 300) - 1)), max_size=48)

    @settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(ids=ids_st, skip=st.booleans(), stop=st.lists(st.text(min_size=1, max_size=3), max_size=2))
    def check(ids, skip, stop):
        detok, pieces = _stream(tok, ids, skip_special_tokens=skip, stop=stop)
        for piece in pieces:
            piece.encode("utf-8")  # no lone surrogates
        full = tok.decode(ids, skip_special_tokens=skip)
        if name == "smollm2" and detok.stop_reason is None:
            assert full.startswith(detok.text)

    check()
