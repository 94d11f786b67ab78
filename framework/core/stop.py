"""Stop conditions and final detokenization of a request (vLLM's ``check_stop`` + detokenizer)."""

from __future__ import annotations

import logging
from typing import Any

from framework.core.detokenizer import IncrementalDetokenizer
from framework.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class StopChecker:
    """Decides whether a request is finished after each appended token.

    Order of checks (as vLLM V1): ``min_tokens`` (nothing stops before it), EOS (unless
    ``ignore_eos``), ``stop_token_ids``, stop strings, ``max_tokens``, ``max_model_len``.

    Args:
        tokenizer: HF tokenizer used for stop strings and the final text; may be None when
            requests are given as token ids and no stop strings are used.
    """

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}  # unfinished requests by id

    def check(self, request: Request, max_model_len: int) -> bool:
        """Set the request's terminal status if its last token ends it; returns True if so.

        Mutates ``request.status``, ``request.stop_reason`` and ``request.output_text``, which
        grows incrementally (:class:`~framework.core.detokenizer.IncrementalDetokenizer`; O(1) tokens
        decoded per call) and is trimmed at a stop-string match unless ``include_stop_str_in_output``.

        Raises:
            ValueError: stop strings without a tokenizer.
        """
        params = request.sampling_params
        last = request.output_token_ids[-1]
        stop = None
        if self.tokenizer is not None:
            detok = self._detokenizers.get(request.request_id)
            if detok is None:
                detok = self._detokenizers[request.request_id] = IncrementalDetokenizer(
                    self.tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output)
            stop = detok.append(last, check_stop=request.num_output_tokens >= params.min_tokens)
            request.output_text = detok.text
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return self._stop(request, RequestStatus.FINISHED_STOPPED, None)
            if last in params.stop_token_ids:
                return self._stop(request, RequestStatus.FINISHED_STOPPED, last)
            if params.stop:
                if self.tokenizer is None:
                    raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
                if stop is not None:
                    return self._stop(request, RequestStatus.FINISHED_STOPPED, stop)
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return self._stop(request, RequestStatus.FINISHED_LENGTH, None)
        if request.num_tokens >= max_model_len:
            return self._stop(request, RequestStatus.FINISHED_LENGTH, None)
        return False

    @staticmethod
    def _stop(request: Request, status: RequestStatus, reason: int | str | None) -> bool:
        request.status = status
        request.stop_reason = reason
        return True

    def finalize(self, request: Request) -> None:
        """Fill ``request.output_text`` for a finished request (unless a stop string already did).

        The final text is one full ``decode`` of the output (the same text as before streaming
        existed, so offline results are unchanged); the per-request detokenizer is dropped. Should the
        tokenizer's ``decode`` raise, the incremental text is kept (logged): a request's text never
        fails its finish.
        """
        self._detokenizers.pop(request.request_id, None)
        if self.tokenizer is not None and request.stop_reason not in request.sampling_params.stop:
            try:
                request.output_text = self.tokenizer.decode(
                    request.output_token_ids, skip_special_tokens=request.sampling_params.skip_special_tokens)
            except Exception:  # noqa: BLE001 - see the docstring
                logger.exception("request %s: final decode failed; keeping its incremental text",
                                 request.request_id)
