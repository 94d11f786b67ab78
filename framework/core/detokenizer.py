"""Incremental detokenization and stop-string matching (vLLM V1 ``IncrementalDetokenizer``).

Text is produced with the tokenizer's own ``decode`` over a short window of ids, the "prefix /
read offset" scheme of vLLM (``vllm/transformers_utils/detokenizer_utils.py``): the new text of a
step is ``decode(ids[prefix:]) - decode(ids[prefix:read])``; it is emitted only when it does not
end in U+FFFD, so a multi-byte character split over several byte tokens (SentencePiece byte
fallback, byte-level BPE) is held until complete. Works for SentencePiece and byte-level BPE
tokenizers alike because both differences are taken with the same decoder.

For a fast (``tokenizers``-backed) tokenizer that does no clean-up of tokenization spaces, the same
scheme runs inside ``tokenizers.decoders.DecodeStream`` (Rust; what vLLM V1's
``FastIncrementalDetokenizer`` uses): one call per token instead of two Python ``decode`` calls,
0.35 -> 0.07 ms per decode step of 64 requests on SmolLM2 here, with the same text (tested against
the Python path on both tokenizer families).

``DecodeStream`` raises ``Invalid prefix encountered`` when a new token changes text it already
produced: SentencePiece's ``ByteFallback`` decoder turns every byte token of an invalid UTF-8 run into
U+FFFD, so a valid byte token (``<0x58>`` = "X") becomes U+FFFD once an invalid byte follows it, which
random-weight or high-temperature sampling produces easily (vLLM issue 17448). On any ``DecodeStream``
error the request's detokenizer switches for good to the Python path, restarted from its recent tokens
(the last few already-printed ids as context plus the ids not yet printed), as vLLM V1's
``FastIncrementalDetokenizer`` recovers; invalid bytes then come out as U+FFFD in the text.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
#: Already-printed ids kept as decoder context for a switch from ``DecodeStream`` to the Python path
#: (SentencePiece needs the previous token to place a leading space; vLLM's prefix window is ~5 tokens).
_CONTEXT_TOKENS = 4


def _decode_stream(tokenizer: Any, skip_special_tokens: bool) -> tuple[Any, Any] | None:
    """``(DecodeStream, backend tokenizer)`` for a fast tokenizer whose ``decode`` is exactly the
    backend's (no ``clean_up_tokenization_spaces``); ``None`` otherwise (the Python path is used)."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - transformers always ships tokenizers
        return None
    if not isinstance(backend, Tokenizer):
        return None
    return DecodeStream(skip_special_tokens=skip_special_tokens), backend


class IncrementalDetokenizer:
    """Output text of one request, grown one token at a time, with stop strings checked on the new text.

    Each :meth:`append` decodes O(window) tokens (usually 2), never the whole output, and searches
    stop strings only in the last ``len(new text) + max stop length - 1`` characters.

    Args:
        tokenizer: HF tokenizer (``decode(ids, skip_special_tokens=...) -> str``).
        skip_special_tokens: passed to ``decode``.
        stop: stop strings; the text is cut at the first match.
        include_stop_str_in_output: keep the matched stop string in ``text``.
        use_decode_stream: decode through ``tokenizers``' ``DecodeStream`` where the tokenizer
            allows it (see the module docstring); ``False`` forces the Python ``decode`` path.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, use_decode_stream: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        # output ids seen so far on the Python path; with DecodeStream only the last few printed ids plus the
        # ids not printed yet (what a switch to the Python path restarts from)
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start (context for the decoder), index into token_ids
        self.read_offset = 0  # ids before this are already in ``text``
        self.text = ""  # output text so far (trimmed at a stop string once one matched)
        self.stop_reason: str | None = None  # the stop string that matched, if any
        self._stream = _decode_stream(tokenizer, skip_special_tokens) if use_decode_stream else None

    @property
    def stop_buffer_length(self) -> int:
        """Characters a stream must hold back while running: a stop string may still complete there."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one output token; returns the stop string it completed (``text`` is then trimmed), else None.

        ``check_stop=False`` (before ``min_tokens``) only grows the text.
        """
        if self.stop_reason is not None:
            return self.stop_reason
        delta = self._stream_delta(token_id) if self._stream is not None else self._window_delta(token_id)
        if not delta:
            return None  # nothing printable yet (special token skipped, or an incomplete character)
        self.text += delta
        return self._check_stop(len(delta)) if check_stop else None

    def _stream_delta(self, token_id: int) -> str | None:
        """New text after ``token_id`` from ``DecodeStream`` (``None``/empty while nothing is printable);
        on a ``DecodeStream`` error, the Python path from here on (module docstring)."""
        stream, backend = self._stream
        try:
            delta = stream.step(backend, token_id)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix ...")
            logger.info("DecodeStream failed on token %d (%s); this request's text continues on the Python "
                        "detokenizer", token_id, exc)
            self._stream = None
            self.prefix_offset = 0  # read_offset: the printed ids kept as context
            return self._window_delta(token_id)
        self.token_ids.append(token_id)
        if delta:  # everything so far is printed: keep only the context a restart needs
            self.token_ids = self.token_ids[-_CONTEXT_TOKENS:]
            self.read_offset = len(self.token_ids)
        return delta

    def _window_delta(self, token_id: int) -> str:
        """New text after ``token_id`` by the prefix/read-offset scheme over ``tokenizer.decode``
        (empty while nothing is printable)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]

    def _check_stop(self, num_new_chars: int) -> str | None:
        for stop in self.stop:
            start = max(0, len(self.text) - num_new_chars - len(stop) + 1)
            pos = self.text.find(stop, start)
            if pos >= 0:
                self.text = self.text[:pos + len(stop)] if self.include_stop_str_in_output else self.text[:pos]
                self.stop_reason = stop
                return stop
        return None

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
