"""Stop conditions and final detokenization of a request (vLLM's ``check_stop`` + detokenizer)."""

from __future__ import annotations

from typing import Any

from framework.request import Request, RequestStatus


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

    def check(self, request: Request, max_model_len: int) -> bool:
        """Set the request's terminal status if its last token ends it; returns True if so.

        Mutates ``request.status``, ``request.stop_reason`` and, on a stop-string match,
        ``request.output_text`` (trimmed at the match unless ``include_stop_str_in_output``).
        """
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return self._stop(request, RequestStatus.FINISHED_STOPPED, None)
            if last in params.stop_token_ids:
                return self._stop(request, RequestStatus.FINISHED_STOPPED, last)
            if params.stop and self._match_stop_string(request):
                return True
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

    def _match_stop_string(self, request: Request) -> bool:
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
        params = request.sampling_params
        text = self._decode(request)
        for stop in params.stop:
            pos = text.find(stop)
            if pos >= 0:
                request.output_text = text[: pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
                return self._stop(request, RequestStatus.FINISHED_STOPPED, stop)
        return False

    def _decode(self, request: Request) -> str:
        return self.tokenizer.decode(request.output_token_ids,
                                     skip_special_tokens=request.sampling_params.skip_special_tokens)

    def finalize(self, request: Request) -> None:
        """Fill ``request.output_text`` for a finished request (unless a stop string already did)."""
        if self.tokenizer is not None and request.stop_reason not in request.sampling_params.stop:
            request.output_text = self._decode(request)
