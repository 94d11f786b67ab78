"""Input processing (vLLM V1's ``Processor``, ``vllm/v1/engine/processor.py``): a prompt and its sampling params
become validated :class:`~framework.core.request.Request` objects before anything reaches the scheduler.

Checks, each a ``ValueError`` naming the fix, with nothing queued: sampling params (``SamplingParams.validate``),
structured output without a grammar engine, stop strings without a tokenizer, ``logit_bias`` ids outside the
vocabulary, an empty prompt, prompt ids outside the vocabulary, a prompt longer than ``max_model_len``, a request id
in use, a LoRA adapter that cannot be served (``framework/engine/lora_support.py``). ``n > 1`` fans out into child requests (``framework/engine/parallel_sampling.py``), every child's params
checked before any is returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from framework.core.clock import Clock
from framework.core.lora_request import LoRARequest
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.engine.parallel_sampling import ParentRequest, child_sampling_params


class Processor:
    """Validates and tokenizes requests for one engine.

    Args:
        tokenizer: the model's tokenizer (``None``: token-id prompts only).
        vocab_size: logits columns (valid ids are ``[0, vocab_size)``).
        max_model_len: prompt + output cap, tokens.
        eos_token_ids: ids that end a request (copied into each request).
        has_grammar: whether the engine has a grammar engine (structured outputs need one).
        clock: the engine's clock (arrival times default to now on it).
        check_lora: the engine's check of a request's LoRA adapter (``LoRAAdmission.check``: raises ``ValueError``
            for a bad adapter, or any adapter with LoRA off); ``None`` refuses every adapter.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 has_grammar: bool, clock: Clock,
                 check_lora: Callable[[LoRARequest | None], None] | None = None) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.eos_token_ids, self.has_grammar, self.clock = eos_token_ids, has_grammar, clock
        self.check_lora = check_lora

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (text: the tokenizer's, special tokens added), checked against the vocabulary
        and ``max_model_len``.

        Raises:
            ValueError: no tokenizer for a text prompt, an empty prompt, ids outside ``[0, vocab_size)``, or more
                than ``max_model_len`` tokens.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt token ids")
            token_ids = list(self.tokenizer(prompt).input_ids)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise ValueError("empty prompt: give at least one token")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got "
                             f"min {min(token_ids)}, max {max(token_ids)}")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; "
                             "shorten the prompt or raise max_model_len (up to the model's max positions)")
        return token_ids

    def validate(self, params: SamplingParams) -> None:
        """Check ``params`` against this engine.

        Raises:
            ValueError: invalid params, structured outputs without a grammar engine, stop strings without a
                tokenizer, or ``logit_bias`` ids outside the vocabulary.
        """
        params.validate()
        if params.structured_outputs is not None and not self.has_grammar:
            raise ValueError("structured_outputs needs a grammar engine but grammar=none; "
                             "use grammar=xgrammar (default) or grammar=llguidance")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer but this engine has none; pass stop_token_ids instead")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size}); got {max(params.logit_bias)}")

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None, priority: int,
                arrival_time: float | None, client_id: str | None,
                in_use: Callable[[str], bool],
                lora_request: LoRARequest | None = None) -> tuple[ParentRequest | None, list[Request]]:
        """The requests to queue for one call of ``add_request``: one, or ``params.n`` children of a parent.

        Args:
            arrival_time: seconds on the engine's clock; ``None``: now.
            in_use: whether a request id is taken (queued, running, or a parent in flight).
            lora_request: the LoRA adapter every resulting request runs under (``None``: the base model).

        Returns:
            The parent (``n > 1``, else ``None``) and the requests, not yet queued.

        Raises:
            ValueError: see the module docstring; nothing was changed.
        """
        params = params or SamplingParams()
        self.validate(params)
        if lora_request is not None:
            if self.check_lora is None:
                raise ValueError("this engine serves no LoRA adapters; build it with enable_lora=True")
            self.check_lora(lora_request)
        token_ids = self.tokenize(prompt)
        parent = ParentRequest(request_id, params) if params.n > 1 else None
        ids = parent.child_ids if parent is not None else [request_id]
        if any(in_use(rid) for rid in {request_id, *ids}):
            raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
        each = [child_sampling_params(params, i) for i in range(params.n)] if parent is not None else [params]
        arrival = self.clock.now() if arrival_time is None else arrival_time
        return parent, [Request(request_id=rid, prompt_token_ids=token_ids, sampling_params=sp,
                                prompt=prompt if isinstance(prompt, str) else None, priority=priority,
                                client_id=client_id, eos_token_ids=self.eos_token_ids, arrival_time=arrival,
                                lora_request=lora_request)
                        for rid, sp in zip(ids, each)]
